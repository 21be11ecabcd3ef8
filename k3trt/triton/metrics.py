"""What the engine model hands to Triton besides responses: its logs (into Triton's log) and its
metrics (into Triton's /metrics, port 8002 by default), plus the response tensors' encoding.

The metrics are the OpenAI server's (serve.metrics.render of an EngineLoop snapshot: queues,
cache blocks and KDA slots in use, finished requests by reason, tokens, speculative acceptance),
republished as Triton custom metrics labelled with the model and instance, so one dashboard
reads both front ends. Counters are republished as increments of the rendered totals.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from k3trt.triton.schema import OUTPUTS

log = logging.getLogger(__name__)

_SERIES = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?$')
_NUMPY = {"STRING": np.object_, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}
_DTYPES = {t.name: _NUMPY[t.dtype] for t in OUTPUTS}


def output_tensors(pb: Any, fields: dict[str, Any]) -> list:
    """pb_utils.Tensor per output (one element each; text as UTF-8 bytes)."""
    out = []
    for name, value in fields.items():
        dtype = _DTYPES[name]
        arr = np.array([value.encode() if dtype is np.object_ else value], dtype=dtype)
        out.append(pb.Tensor(name, arr))
    return out


class _TritonLog(logging.Handler):
    def __init__(self, pb: Any):
        super().__init__()
        self.logger = pb.Logger
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg, lg, level = self.format(record), self.logger, record.levelno
            (lg.log_error if level >= logging.ERROR else lg.log_warn if level >= logging.WARNING
             else lg.log_info if level >= logging.INFO else lg.log_verbose)(msg)
        except Exception:                    # the stub is shutting down: stderr still works
            self.handleError(record)


def forward_logs(pb: Any) -> None:
    """Route the `k3trt` loggers into Triton's log (once per process)."""
    root = logging.getLogger("k3trt")
    if not any(isinstance(h, _TritonLog) for h in root.handlers):
        root.addHandler(_TritonLog(pb))
        if root.level == logging.NOTSET:
            root.setLevel(logging.INFO)


class TritonMetrics:
    def __init__(self, pb: Any, labels: dict[str, str]):
        self.pb, self.labels = pb, labels
        self.available = hasattr(pb, "MetricFamily")
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple, tuple[Any, float]] = {}      # (name, labels) -> (metric, last total)
        self._broken: set[str] = set()
        if not self.available:
            log.warning("this Triton's Python backend has no custom metrics; k3trt metrics are not published")

    def update(self, text: str) -> None:
        """Publish a Prometheus text rendering (serve.metrics.render)."""
        if not self.available:
            return
        helps, kinds = {}, {}
        for line in text.splitlines():
            if line.startswith("# HELP "):
                name, _, help_ = line[7:].partition(" ")
                helps[name] = help_
            elif line.startswith("# TYPE "):
                name, _, kind = line[7:].partition(" ")
                kinds[name] = kind
            elif line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                m = _SERIES.match(series)
                if m:
                    base = next((n for n in (m[1], m[1].rsplit("_", 1)[0]) if n in kinds), m[1])
                    labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2] or ""))
                    self._set(m[1], helps.get(base, m[1]), kinds.get(base, "gauge") != "gauge", labels, float(value))

    def close(self) -> None:
        """Drop the metrics, then their families: the stub crashes at exit if a family goes first
        (Triton 2.51), and interpreter teardown picks no order."""
        self._metrics.clear()
        self._families.clear()
        self.available = False

    def _set(self, name: str, help_: str, counter: bool, labels: dict, value: float) -> None:
        if name in self._broken:
            return
        key = (name, tuple(sorted(labels.items())))
        try:
            if key not in self._metrics:
                if name not in self._families:
                    kind = self.pb.MetricFamily.COUNTER if counter else self.pb.MetricFamily.GAUGE
                    self._families[name] = self.pb.MetricFamily(name=name, description=help_, kind=kind)
                self._metrics[key] = (self._families[name].Metric(labels={**self.labels, **labels}), 0.0)
            metric, last = self._metrics[key]
            if counter:
                if value > last:
                    metric.increment(value - last)
            else:
                metric.set(value)
            self._metrics[key] = (metric, value)
        except Exception:
            self._broken.add(name)
            log.warning("Triton refused the metric %s; it is left out", name, exc_info=True)
