"""`python -m eqx_longctx.eval`: score a model on the long-context tasks (see
`eqx_longctx.evals`)."""

if __name__ == "__main__":
    from eqx_longctx.evals import eval_main

    raise SystemExit(eval_main())
