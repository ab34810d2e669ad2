"""`python -m eqx_longctx.generate`: print a model's continuation of a prompt (see
`eqx_longctx.inference.generate_main`).

This file exists only to be run with `-m`. The package attribute `eqx_longctx.generate` is
the function `eqx_longctx.inference.generate`, and stays so when this module is imported
(the package's module type refuses to let the import replace it).
"""

if __name__ == "__main__":
    from eqx_longctx.inference import generate_main

    raise SystemExit(generate_main())
