"""Run a Python program with the bridge started, no code change needed::

    python -m gpumem_bridge train.py --lr 0.1
    python -m gpumem_bridge -m my.package.main --lr 0.1

The program sees the same ``sys.argv`` (and, for a script, the same
``sys.path[0]``) as if it had been started with ``python`` directly.
"""

import os
import runpy
import sys

from . import start

USAGE = "usage: python -m gpumem_bridge (SCRIPT | -m MODULE) [ARGS...]"


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        start()
        sys.argv = args[1:]
        # run_module sets sys.argv[0] to the module's file, as `python -m` does.
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    script = args[0]
    start()
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
