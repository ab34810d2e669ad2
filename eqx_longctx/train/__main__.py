"""`python -m eqx_longctx.train`: see `eqx_longctx.train._cli`."""

from ._cli import main

raise SystemExit(main())
