"""Bytes and seconds as people read them, for every table the library prints (the
attention planner's, the step planner's, the inference planner's)."""


def gib(x: int | float) -> str:
    """Bytes in the largest binary unit they reach, to three figures (`"1.5 GiB"`)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            v = x / size
            return f"{v:.0f} {unit}" if v >= 1000 else f"{v:.3g} {unit}"
    return f"{int(x)} B"


def sec(x: float) -> str:
    """Seconds, or milliseconds under one second, to three figures."""
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms"
