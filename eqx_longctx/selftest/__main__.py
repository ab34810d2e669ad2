"""`python -m eqx_longctx.selftest`: see `eqx_longctx.selftest`."""

from . import main

raise SystemExit(main())
