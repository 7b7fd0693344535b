"""python -m megakernel.capi build [--out DIR]: libmegakernel.so and the example program (see __init__)."""

import argparse
import sys
from pathlib import Path

from . import HERE, build


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megakernel.capi", description=__doc__)
    p.add_argument("command", choices=["build"])
    p.add_argument("--out", type=Path, default=Path("build/capi"), help="where the library and example go")
    args = p.parse_args(argv)
    try:
        lib, example = build(args.out)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"built {lib} and {example}; header {HERE / 'megakernel.h'}")
    print(f"try: {example} tiny-moe cpu 64 8 1 2 3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
