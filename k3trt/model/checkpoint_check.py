"""Check a checkpoint's weight index against its config from the safetensors headers alone: names
(k3trt/model/layout.py), shapes and dtypes, without reading any weight. Every problem is listed at
once; a name the layout does not know is shown with the nearest known rule, so that an unknown
layout says what it should have been called. Every problem line names the file (the shard, or the
index for a missing tensor) and the tensor, and the message ends with the fix for each kind of
problem. A damaged file (missing or truncated shard, bad header, index naming absent tensors) is
refused with the file and the fix too, and the config's nested ``model_type`` (``text_config``)
must be one the model code implements.
"""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3trt.config import TEXT_MODEL_TYPES, TOP_MODEL_TYPE, ModelConfig
from k3trt.model.checkpoint_io import INDEX_NAME, SINGLE_NAME, CheckpointError, CheckpointReader
from k3trt.model.k3 import K3ForCausalLM
from k3trt.model.layout import PREFIX_ALIASES, checkpoint_prefix, copy_of, source, template, tensor_prefix
from k3trt.model.quant import WEIGHT_SUFFIXES, inspect_linear_weight
from k3trt.parallel.comm import SINGLE, Comm
from k3trt.parallel.config import ParallelConfig
from k3trt.parallel.shard import param_part

log = logging.getLogger(__name__)

__all__ = ["Expected", "Report", "WeightError", "check_model_types", "check_reader", "expected_tensors", "linear_like",
           "open_checkpoint", "pick_name", "validate_weights"]

SHOWN = 8       # problems of each kind quoted in an error message
DAMAGED_FIX = ("fix: the checkpoint's files are damaged or incomplete: download or copy the checkpoint again "
               "(every shard its index names, whole)")
# the fix for each kind of problem Report lists: (attribute, fix)
FIXES = (
    ("wrong", "fix (wrong shape or dtype): the weights do not match config.json's dimensions or are not floating "
              "point: use the config.json published with these weights, or download the checkpoint again"),
    ("missing", "fix (missing): the checkpoint lacks tensors its config.json needs: download or copy the missing "
                "shards again, or use the config.json published with these weights"),
    ("unexpected", "fix (unexpected): tensors the model does not have: use the checkpoint this config.json belongs "
                   "to, or rename them as the nearest known rule says"),
)


class WeightError(ValueError):
    """A checkpoint whose tensors do not fit the model; the message names the tensor."""


def linear_like(name: str, shape) -> bool:
    """Tensors that may be stored quantized (fp8 blocks / mxfp4): 2-D projection weights."""
    return name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name


def _present(reader, name: str) -> bool:
    if name in reader:
        return True
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and any(f"{module}.{s}" in reader for s in WEIGHT_SUFFIXES)


def pick_name(reader, names) -> str:
    """The first of `names` (spellings of one tensor, published first) the checkpoint holds; the
    published one if none is there (so that the error names it)."""
    return next((n for n in names if _present(reader, n)), names[0])


@dataclass(frozen=True)
class Expected:
    """One checkpoint tensor the model needs: its accepted spellings (published first) and shape."""
    param: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    stored: tuple[int, ...]


def expected_tensors(cfg: ModelConfig, pc: ParallelConfig | None = None) -> list[Expected]:
    """Every checkpoint tensor the config's model needs, from a meta model: whole, or with `pc`
    rank pc.rank's slices as its rank dir holds them (model/rank_checkpoint.py)."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, Comm(pc) if pc is not None else SINGLE)
    out = []
    for pname, p in model.named_parameters():
        src, shape = source(pname, cfg), tuple(p.shape)
        prefix = tensor_prefix(src, cfg)
        if src.combine == "stack":
            part = param_part(pname, pc) if pc is not None else None
            mine = part.range(len(src.names)) if part is not None and part.dim == 0 else range(len(src.names))
            out += [Expected(pname, (prefix + src.names[e],), shape[1:], shape[1:]) for e in mine]
        elif src.combine == "cat":
            out += [Expected(pname, (prefix + n,), (s, *shape[1:]), (s, *shape[1:]))
                    for n, s in zip(src.names, src.rule.split(cfg))]
        else:
            out.append(Expected(pname, tuple(prefix + n for n in (*src.names, *src.also)), shape,
                                src.stored_shape(shape)))
    return out


@dataclass
class Report:
    """What check_reader found; `ok` when nothing. Problems are kept per kind as (checkpoint name,
    line); the message shows one line per rule (template) with a count of the others like it."""
    where: str
    missing: list[tuple[str, str]] = field(default_factory=list)
    unexpected: list[tuple[str, str]] = field(default_factory=list)
    wrong: list[tuple[str, str]] = field(default_factory=list)
    params: int = 0
    weight_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong)

    def message(self) -> str:
        n = len(self.missing) + len(self.unexpected) + len(self.wrong)
        lines = [(f"checkpoint {self.where} does not fit its config.json: {n} problems "
                  f"({len(self.missing)} missing, {len(self.unexpected)} unexpected, {len(self.wrong)} wrong "
                  "shape or dtype)")]
        for kind in (self.wrong, self.missing, self.unexpected):
            groups: dict[str, list[str]] = {}
            for name, line in kind:
                groups.setdefault(template(name), []).append(line)
            for i, same in enumerate(groups.values()):
                if i == SHOWN:
                    lines.append(f"  ... and {len(groups) - SHOWN} more kinds")
                    break
                lines.append(f"  {same[0]}" + (f" [and {len(same) - 1} more like it]" if len(same) > 1 else ""))
        lines += [f"  {fix}" for kind, fix in FIXES if getattr(self, kind)]
        return "\n".join(lines)

    def raise_if_bad(self) -> None:
        if not self.ok:
            raise WeightError(self.message())


def _shard(reader, name: str) -> str:
    """Where tensor `name` is stored: its shard's path (a quantized weight's: its first part's)."""
    module = name.removesuffix(".weight")
    stored = next((n for n in (name, *(f"{module}.{s}" for s in WEIGHT_SUFFIXES)) if n in reader), None)
    return str(reader.path / reader.info(stored).shard) if stored else str(reader.path)


def _check_one(reader, exp: Expected, name: str, used: set[str], report: Report) -> None:
    if linear_like(name, exp.shape):
        module = name.removesuffix(".weight")
        try:
            _, shape, suffixes = inspect_linear_weight(reader, module)
        except CheckpointError as e:
            report.wrong.append((name, f"{_shard(reader, name)}: {e}"))
            used.update(f"{module}.{s}" for s in WEIGHT_SUFFIXES)
            return
        used.update(f"{module}.{s}" for s in suffixes)
        report.weight_bytes += sum(reader.info(f"{module}.{s}").nbytes for s in suffixes)
    else:
        info = reader.info(name)
        used.add(name)
        report.weight_bytes += info.nbytes
        shape = info.shape
        if not info.dtype.is_floating_point:
            report.wrong.append((name, f"{_shard(reader, name)}: tensor '{name}' has dtype {info.dtype}; expected a "
                                       "floating type (bf16, fp16 or fp32)"))
            return
    if tuple(shape) not in (exp.shape, exp.stored):
        msg = (f"{_shard(reader, name)}: tensor '{name}' has shape "
               f"{tuple(shape)}; model parameter '{exp.param}' expects {exp.shape}")
        report.wrong.append((name, msg))


def check_reader(reader: CheckpointReader, cfg: ModelConfig, pc: ParallelConfig | None = None) -> Report:
    """Check every tensor name, shape and dtype of `reader`'s index against `cfg`'s model (with
    `pc`: against rank pc.rank's slices, for a rank dir)."""
    report, used, known, nearest = Report(str(reader.path)), set(), set(), {}
    prefix = checkpoint_prefix(cfg)
    for exp in expected_tensors(cfg, pc):
        known.update(template(n) for n in exp.names)
        report.params += int(torch.Size(exp.shape).numel())
        name = pick_name(reader, exp.names)
        if not _present(reader, name):
            report.missing.append((name, f"{_index(reader)}: missing tensor '{name}' (model parameter '{exp.param}')"))
            continue
        _check_one(reader, exp, name, used, report)
    for name in reader.names():
        if name in used:
            continue
        main = copy_of(name.removeprefix(prefix), cfg)
        if main is not None:
            main = prefix + (main if prefix + main in reader else "model.embed_tokens.weight")
            if main in reader and reader.shape(name) != reader.shape(main):
                msg = (f"{_shard(reader, name)}: tensor '{name}' (an MTP layer's copy of '{main}') has shape "
                       f"{reader.shape(name)}; "
                       f"'{main}' has {reader.shape(main)}")
                report.wrong.append((name, msg))
            continue
        tmpl = template(name)
        if tmpl not in nearest:
            near = difflib.get_close_matches(tmpl, sorted(known), n=1, cutoff=0.0)
            nearest[tmpl] = f" (nearest known rule: '{near[0]}')" if near else ""
        report.unexpected.append((name, f"{_shard(reader, name)}: unexpected tensor '{name}'{nearest[tmpl]}"))
    return report


def _index(reader) -> str:
    """The file that says which tensors the checkpoint has: its index, or its single file."""
    index = reader.path / INDEX_NAME
    return str(index if index.is_file() else reader.path / SINGLE_NAME)


def check_model_types(ckpt_dir: str | Path) -> None:
    """Refuse a nested ``model_type`` the model code does not implement (``text_config.model_type``
    of a kimi_k3 config): the top-level one alone does not say which text model the weights are."""
    path = Path(ckpt_dir) / "config.json"
    raw = json.loads(path.read_text())
    text = raw.get("text_config") if raw.get("model_type") == TOP_MODEL_TYPE else None
    if isinstance(text, dict) and "model_type" in text and text["model_type"] not in TEXT_MODEL_TYPES:
        raise WeightError(f"{path}: field 'text_config.model_type' is {text['model_type']!r}; a {TOP_MODEL_TYPE} "
                          f"checkpoint's text model is one of {TEXT_MODEL_TYPES}. fix: use the config.json published "
                          f"with these weights (this is not a Kimi K3 checkpoint, or its config.json was edited)")


def open_checkpoint(ckpt_dir: str | Path, cfg: ModelConfig) -> CheckpointReader:
    """A reader over `ckpt_dir` presenting the names of the published layout (PREFIX_ALIASES)."""
    reader = CheckpointReader(ckpt_dir)
    if checkpoint_prefix(cfg):
        n = reader.alias_prefixes(PREFIX_ALIASES)
        if n:
            log.info("%d tensors named %s are read as %s", n, *PREFIX_ALIASES[0])
    return reader


def validate_weights(ckpt_dir: str | Path, cfg: ModelConfig) -> Report:
    """check_reader over the checkpoint at `ckpt_dir`; raises WeightError listing every problem,
    else logs what the weights hold and returns the report."""
    check_model_types(ckpt_dir)
    try:
        reader = open_checkpoint(ckpt_dir, cfg)
    except CheckpointError as e:
        raise CheckpointError(f"{e}\n  {DAMAGED_FIX}") from None
    with reader:
        report = check_reader(reader, cfg)
    report.raise_if_bad()
    log.info("checkpoint %s fits its config: %.2fB parameters, %.2f GB of weights",
             ckpt_dir, report.params / 1e9, report.weight_bytes / 1e9)
    return report
