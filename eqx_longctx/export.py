"""`python -m eqx_longctx.export --run-dir DIR --out HF_DIR`: write the newest checkpoint of
a training run as a Hugging Face checkpoint directory (see `eqx_longctx.train.export_run`;
the command line is `eqx_longctx.train.export_main`).
"""

if __name__ == "__main__":
    from eqx_longctx.train import export_main

    raise SystemExit(export_main())
