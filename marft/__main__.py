"""``python -m marft``: the ``marft`` command (:mod:`marft.cli.main`)."""

from marft.cli.main import main

raise SystemExit(main())
