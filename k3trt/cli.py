"""The ``k3trt`` command line: one click group, each command a thin layer over the Python API."""

from __future__ import annotations

import logging
import sys

import click

from k3trt import __version__
from k3trt.model.presets import PRESETS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3trt")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str) -> None:
    """Compile and serve Kimi K3."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


@main.command("make-checkpoint")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option("--output", "-o", type=click.Path(file_okay=False), required=True, help="new checkpoint directory")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quant", type=click.Choice(["none", "fp8", "mxfp4"]), default="none", show_default=True,
              help="fp8: block-scaled e4m3 projections; mxfp4: routed experts as K3 ships them")
@click.option("--device", default="cpu", show_default=True, help="where to generate the random weights")
def make_checkpoint_cmd(preset: str, output: str, seed: int, quant: str, device: str) -> None:
    """Write a random-weight Kimi K3 checkpoint in the real Hugging Face layout."""
    from k3trt.model.make_checkpoint import make_checkpoint
    try:
        path = make_checkpoint(preset, output, seed=seed, quant=quant, device=device)
    except (FileExistsError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(path))


if __name__ == "__main__":
    main()
