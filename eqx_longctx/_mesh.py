"""Mesh shapes written as text (`"data=2,context=4"`), as the CLIs take them."""

MESH_AXES = ("data", "fsdp", "expert", "ulysses", "context", "tensor")


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,context=4"` -> `{"data": 2, "context": 4}` (axes in the order given).

    **Arguments:**

    - `text`: comma-separated `AXIS=SIZE` parts; axes from `MESH_AXES`, each at most once,
      sizes positive integers, `context` required.

    **Returns:** the axis sizes.

    **Raises:** `TypeError` when `text` is not a string; `ValueError` (naming the bad part
    and the fix) for a part that is not `AXIS=SIZE` with an axis from `MESH_AXES`, a size
    that is not a positive integer, an axis named twice, or no `context` axis.
    """
    if not isinstance(text, str):
        raise TypeError(
            f"--mesh must be a string such as 'data=2,context=4'; got {type(text).__name__} "
            f"{text!r}. Pass the axis sizes as AXIS=SIZE parts joined by commas."
        )
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or name not in MESH_AXES:
            raise ValueError(
                f"--mesh takes AXIS=SIZE parts with axes from {MESH_AXES}; got --mesh {text!r} "
                f"(bad part {part!r}). Pass e.g. --mesh data=2,context=4."
            )
        if not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"--mesh axis sizes must be positive integers; got --mesh {text!r} (axis "
                f"{name!r} has size {size!r}). Pass e.g. {name}=2."
            )
        if name in shape:
            raise ValueError(
                f"--mesh names each axis at most once; got --mesh {text!r}, where {name!r} "
                f"appears twice ({name}={shape[name]} and {name}={size}). Keep one {name}=SIZE "
                "part."
            )
        shape[name] = int(size)
    if "context" not in shape:
        raise ValueError(
            f"--mesh needs a 'context' axis (the sequence is split over it); got --mesh "
            f"{text!r}. Add context=1 for plain data parallelism."
        )
    return shape
