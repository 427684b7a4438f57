"""``python3 -I -S <this folder> [candidate]``: the harness as a program (see ``__init__.py``).

Isolated mode (``-I``, which implies ``-P``) puts no script's folder on ``sys.path``, but a folder that Python runs
by its ``__main__.py`` is the one entry it always puts first, ``-P`` or not (as for a zip file). Here that entry
gives way, while the harness imports, to the folder's parent at the end of ``sys.path``: the modules of this folder
import as the package ``harness``, with the same relative imports by which marft imports them as
``marft.sandbox.harness``, and nothing beside them can shadow a module of the standard library; ``marft`` itself is
never on the path. Every module here imports its siblings at its top, so the entry is gone again before any program
runs: a candidate's ``sys.path`` is the standard library's alone.
"""

import os
import sys

del sys.path[0]  # this folder: Python put it first, to run it
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the standard library comes first
try:
    from harness.driver import main
finally:
    del sys.path[-1]

if __name__ == "__main__":
    main()
    os._exit(0)  # skip interpreter shutdown
