"""`python -m k3trt ...` is the `k3trt` command."""

from k3trt.cli import main

main()
