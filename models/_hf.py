"""Read and write Hugging Face safetensors checkpoints, for any model family in the zoo.

A family's conversion module (`models/_llama_hf.py`, ...) describes its checkpoint as a
table `{zoo parameter path: HFTensor}`. This module checks a checkpoint against that table before
reading any tensor data (missing, extra and wrongly shaped tensors are all reported by
name), then reads one tensor at a time with `safetensors` (NumPy, no torch) and places each
parameter directly in its sharding, in the requested dtype. Writing goes the other way and
produces files `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

import contextlib
import dataclasses
import json
import math
import os
import re
import string
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, final

import jax
import numpy as np

from eqx_longctx.family import check_int

from ._hf_config import CONFIG_FILE, checkpoint_dir, read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors names of the dtypes read


@final
@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one zoo parameter lives in a Hugging Face checkpoint.

    **Arguments:**

    - `name`: the Hugging Face tensor name. Each `{field}` in it (e.g.
      `"model.layers.{layer}.mlp.up_proj.weight"`) is a stacking axis: the zoo parameter
      has one leading axis per field, in order, built from one tensor per index.
    - `kind`: how the layouts differ.
        - `"same"`: same shape (norms, embeddings).
        - `"flat"`: Hugging Face stores the zoo tensor flattened (`[heads * head_dim]`
          biases).
        - `"linear"`: a `torch.nn.Linear` weight, `[out, in]`; the first `n_in` zoo axes
          are the inputs, the rest the outputs, e.g. `[embed, heads, head_dim]`.
    - `n_in`: number of leading (per-index) zoo axes that are inputs, for `"linear"`.
    - `offsets`: `((field, offset), ...)`: index `i` of that stacking axis is named
      `i + offset` (e.g. a stack of MoE layers that starts after some dense layers).
    - `stored_shape`: for `"same"`, the Hugging Face shape of one tensor where it holds
      the zoo's elements in the same order under another shape (a depthwise convolution's
      `[channels, 1, width]` for the zoo's `[heads, head_dim, width]`); `None`: the zoo's.
    """

    name: str
    kind: Literal["same", "flat", "linear"] = "same"
    n_in: int = 1
    offsets: tuple[tuple[str, int], ...] = ()
    stored_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in ("same", "flat", "linear") or self.n_in < 1:
            raise ValueError(
                f"HFTensor({self.name!r}) needs kind 'same', 'flat' or 'linear' and n_in >= 1; "
                f"got kind={self.kind!r}, n_in={self.n_in}."
            )
        unknown = sorted({f for f, _ in self.offsets} - set(self.fields))
        if unknown:
            raise ValueError(
                f"HFTensor({self.name!r}) has offsets for {unknown}, which are not "
                f"{{fields}} of its name (fields: {list(self.fields)})."
            )
        if self.stored_shape is not None and self.kind != "same":
            raise ValueError(
                f"HFTensor({self.name!r}) gives a stored_shape, which only kind 'same' reads; "
                f"got kind={self.kind!r}."
            )

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.name) if f)

    def names(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str]]:
        """`(index, name)` of every Hugging Face tensor of a zoo parameter of `shape`."""
        fields, offsets = self.fields, dict(self.offsets)
        out = []
        for idx in np.ndindex(*shape[: len(fields)]):
            values = {f: i + offsets.get(f, 0) for f, i in zip(fields, idx, strict=True)}
            out.append((idx, self.name.format(**values)))
        return out

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Hugging Face shape of one tensor, given the zoo shape of one (unstacked) slice."""
        if self.stored_shape is not None:
            return self.stored_shape
        if self.kind == "flat":
            return (math.prod(shape),)
        if self.kind == "linear":
            return (math.prod(shape[self.n_in :]), math.prod(shape[: self.n_in]))
        return tuple(shape)

    def to_zoo(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return (x.T if self.kind == "linear" else x).reshape(shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        hf_shape = self.hf_shape(x.shape)
        if self.kind == "linear":
            x = x.reshape(hf_shape[::-1]).T
        return np.ascontiguousarray(x.reshape(hf_shape))


@final
class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory: one `model.safetensors`, or else the shards
    listed by `model.safetensors.index.json` (transformers' order). Use as a context
    manager; files open lazily."""

    def __init__(self, path: str | os.PathLike):
        path = checkpoint_dir(path)
        index = os.path.join(path, INDEX_FILE)
        single = os.path.join(path, SINGLE_FILE)
        # As transformers: one model.safetensors wins over an index (save_pretrained leaves
        # an old index behind when it rewrites a sharded checkpoint as one file).
        if os.path.isfile(index) and not os.path.isfile(single):
            contents = read_json(index, "shard index")
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(
                    f"{index} has no 'weight_map' (tensor name -> shard file); rewrite it with "
                    "save_pretrained or remove it to load a single model.safetensors."
                )
            bad = sorted(n for n, f in weight_map.items() if not isinstance(f, str))
            if bad:
                raise ValueError(
                    f"{index} maps tensor(s) {_listing(bad)} to something other than a shard "
                    "file name; every weight_map value must be a string. Rewrite it with "
                    "save_pretrained."
                )
            self.files = {name: os.path.join(path, file) for name, file in weight_map.items()}
            self.source = index
        elif os.path.isfile(single):
            self.files = None  # filled on open, from the file's own header
            self.source = single
        else:
            found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            raise ValueError(
                f"{path!r} has neither {SINGLE_FILE} nor {INDEX_FILE} (safetensors files "
                f"found: {found}). Save the checkpoint with save_pretrained(..., "
                "safe_serialization=True); PyTorch .bin checkpoints are not read."
            )
        missing = sorted({f for f in (self.files or {}).values() if not os.path.isfile(f)})
        if missing:
            raise ValueError(
                f"{index} lists shard file(s) that are not in {path!r}: {missing}. "
                "Download every shard of the checkpoint."
            )
        self.path = path
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> "SafetensorsCheckpoint":
        if self.files is None:
            single = os.path.join(self.path, SINGLE_FILE)
            self.files = dict.fromkeys(self._open(single).keys(), single)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def _open(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            try:
                handle = safe_open(file, framework="numpy")
            except Exception as e:  # SafetensorError (a bad header), OSError
                raise ValueError(
                    f"cannot read safetensors file {file}: {e}. The file is damaged or "
                    "incomplete (e.g. an interrupted download); download or write it again."
                ) from e
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    @property
    def names(self) -> set[str]:
        return set(self.files or ())

    def file(self, name: str) -> str:
        """The file that holds tensor `name`."""
        assert self.files is not None, "use SafetensorsCheckpoint as a context manager"
        return self.files[name]

    def _tensor_op(self, name: str, op: Callable[[Any], Any]):
        file = self.file(name)
        handle = self._open(file)
        try:
            return op(handle)
        except Exception as e:  # SafetensorError: absent from its shard, data cut short
            raise ValueError(
                f"cannot read tensor {name!r} from {file}: {e}. The file is damaged, or "
                f"{INDEX_FILE} names the wrong shard for it; download or write it again."
            ) from e

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header (no data read)."""
        return tuple(self._tensor_op(name, lambda h: h.get_slice(name).get_shape()))

    def dtype(self, name: str) -> str:
        """safetensors dtype name from the file header (`"F32"`, `"BF16"`, ...)."""
        return str(self._tensor_op(name, lambda h: h.get_slice(name).get_dtype()))

    def read(self, name: str) -> np.ndarray:
        """Read one tensor into host memory."""
        return self._tensor_op(name, lambda h: h.get_tensor(name))


def _leaf_paths(tree) -> tuple[list[str], list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in leaves]
    return paths, [leaf for _, leaf in leaves], treedef


def shardings_by_path(abstract, spec) -> Callable[[str, tuple[int, ...]], Any]:
    """The `sharding` argument of `load_params` for a model under `spec` (or `None`): each
    parameter's `NamedSharding` from the rules table, looked up by its path."""
    if spec is None:
        return lambda _path, _shape: None
    from eqx_longctx.family import param_shardings

    paths, _, _ = _leaf_paths(abstract)
    table = dict(zip(paths, jax.tree.leaves(param_shardings(abstract, spec)), strict=True))
    return lambda path, _shape: table[path]


def _listing(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


def _check_table(paths: list[str], table: Mapping[str, HFTensor]) -> None:
    untabled, unused = set(paths) - set(table), set(table) - set(paths)
    if untabled or unused:
        raise ValueError(
            f"checkpoint table out of sync with the model: parameters without a Hugging Face "
            f"name {_listing(untabled)}, names for absent parameters {_listing(unused)}."
        )


def load_params(
    abstract,
    table: Mapping[str, HFTensor],
    checkpoint: Any,  # a SafetensorsCheckpoint, or a view of one (models/_hf_fused.py)
    *,
    dtype,
    sharding: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None],
    ignore: Iterable[str] = (),
    tied: Mapping[str, str] | None = None,
):
    """Fill a model skeleton with checkpoint tensors, checking everything before reading.

    **Arguments:**

    - `abstract`: the model from `eqx.filter_eval_shape` (leaves are `ShapeDtypeStruct`s).
    - `table`: `{parameter path: HFTensor}` for every leaf (paths as `jax.tree_util.keystr(
      path, simple=True, separator=".")`, e.g. `"layers.layers.attn.wq"`).
    - `checkpoint`: an open `SafetensorsCheckpoint`, or an object that answers as one does
      (`names`, `shape`, `dtype`, `read`, `file`, `source`, `path`), such as
      `models/_hf_fused.FusedCheckpoint`.
    - `dtype`: parameter dtype; tensors are converted on the host.
    - `sharding`: `(path, shape) -> Sharding` for each parameter, or `None` for the default
      device. Each parameter goes straight to its devices; only one is ever on the host.
    - `ignore`: regular expressions of checkpoint tensors to skip (derived buffers such as
      old `rotary_emb.inv_freq`).
    - `tied`: `{duplicate name: original name}`: a duplicate may be present if it equals the
      original (e.g. `lm_head.weight` of a checkpoint with tied embeddings).

    **Returns:** the model with its leaves replaced by arrays.
    """
    tied = dict(tied or {})
    paths, leaves, treedef = _leaf_paths(abstract)
    _check_table(paths, table)
    expected: dict[str, tuple[int, ...]] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        entry = table[path]
        per_index = tuple(leaf.shape[len(entry.fields) :])
        for _, name in entry.names(leaf.shape):
            expected[name] = entry.hf_shape(per_index)
    skip = [re.compile(p) for p in ignore]
    present = {n for n in checkpoint.names if not any(p.fullmatch(n) for p in skip)}
    missing = set(expected) - present
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint.source} lacks tensor(s) {_listing(missing)} that its "
            "config.json implies. Check that the checkpoint is complete and that config.json "
            "belongs to it."
        )
    # Tensors with no elements carry no weights (transformers writes a DeepSeek's shared
    # experts as [dim, 0] when n_shared_experts=0).
    extra = {n for n in present - set(expected) if n not in tied and 0 not in checkpoint.shape(n)}
    if extra:
        raise ValueError(
            f"checkpoint {checkpoint.source} has tensor(s) {_listing(extra)} that the model "
            "described by its config.json does not use (a different architecture, or "
            "config.json does not match the weights); they are not skipped silently."
        )
    wrong = [
        f"{n}: expected {expected[n]}, found {checkpoint.shape(n)} in "
        f"{os.path.basename(checkpoint.file(n))}"
        for n in sorted(expected)
        if checkpoint.shape(n) != expected[n]
    ]
    if wrong:
        raise ValueError(
            f"checkpoint {checkpoint.path!r} has tensor(s) of the wrong shape for its "
            f"config.json: {'; '.join(wrong[:12])}. Check config.json (sizes, heads, "
            "head_dim) against the weights."
        )
    not_float = [
        f"{n}: {checkpoint.dtype(n)} in {os.path.basename(checkpoint.file(n))}"
        for n in sorted(expected)
        if checkpoint.dtype(n) not in FLOAT_DTYPES
    ]
    if not_float:
        raise ValueError(
            f"checkpoint {checkpoint.path!r} has tensor(s) that are not floating point: "
            f"{'; '.join(not_float[:12])}. Parameters are read from {FLOAT_DTYPES} only "
            "(quantized or integer checkpoints are not read); use an unquantized checkpoint."
        )
    for duplicate, original in tied.items():
        if duplicate in present and not np.array_equal(
            checkpoint.read(duplicate), checkpoint.read(original)
        ):
            raise ValueError(
                f"checkpoint {checkpoint.path!r} ties {duplicate!r} to {original!r} "
                "(config.json says the weights are shared) but stores a different "
                f"{duplicate!r}. Set the tying flag to false in config.json to load both."
            )

    dtype = np.dtype(dtype)
    arrays = []
    for path, leaf in zip(paths, leaves, strict=True):
        entry = table[path]
        shape = tuple(leaf.shape)
        per_index = shape[len(entry.fields) :]
        host = np.empty(shape, dtype)
        for idx, name in entry.names(shape):
            host[idx] = entry.to_zoo(checkpoint.read(name), per_index)
        target = sharding(path, shape)
        if target is None:
            arrays.append(jax.device_put(host))
        else:
            arrays.append(jax.make_array_from_callback(shape, target, lambda i, h=host: h[i]))
        del host
    return jax.tree_util.tree_unflatten(treedef, arrays)


def check_concrete(model, what: str) -> None:
    """Raise `ValueError` if `model` holds abstract shapes (from `eqx.filter_eval_shape`)
    instead of parameter values: there would be nothing to write."""
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(model)):
        raise ValueError(
            f"{what} needs parameter values, but the model holds abstract shapes "
            "(jax.ShapeDtypeStruct, e.g. from eqx.filter_eval_shape). Build it for real, or "
            "load it with from_hf."
        )


def save_params(
    params,
    table: Mapping[str, HFTensor],
    path: object,  # checked below, with an error that names to_hf
    config: Mapping[str, Any],
    *,
    max_shard_size: int | None = None,
) -> None:
    """Write `config.json` and the parameters as Hugging Face safetensors.

    **Arguments:**

    - `params`: the model's arrays (`eqx.filter(model, eqx.is_array)`).
    - `table`: `{parameter path: HFTensor}` for every leaf, as for `load_params`.
    - `path`: output directory (created if needed).
    - `config`: the Hugging Face `config.json` contents.
    - `max_shard_size`: bytes per file; `None` writes one `model.safetensors`, otherwise
      numbered shards and `model.safetensors.index.json` (also bounds host memory).
    """
    from safetensors.numpy import save_file

    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"to_hf needs path=an output directory (str or os.PathLike); got {type(path).__name__}."
        )
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"to_hf writes a checkpoint directory, but {path!r} exists and is not a directory. "
            "Choose a new path or remove the file."
        )
    if max_shard_size is not None:
        max_shard_size = check_int(
            max_shard_size, "to_hf max_shard_size", fix=" Give bytes per file, or None."
        )
    paths, leaves, _ = _leaf_paths(params)
    _check_table(paths, table)
    not_local = [p for p, leaf in zip(paths, leaves, strict=True) if not leaf.is_fully_addressable]
    if not_local:
        raise ValueError(
            f"parameter(s) {_listing(not_local)} are not fully addressable from this process; "
            "gather them first (jax.experimental.multihost_utils.process_allgather) and write "
            "from one process."
        )
    # Plan the files from the shapes alone, then fetch each file's tensors only when writing.
    plan: list[list[tuple[str, int, tuple[int, ...]]]] = [[]]
    size = 0
    for leaf_no, (p, leaf) in enumerate(zip(paths, leaves, strict=True)):
        entry = table[p]
        nbytes = math.prod(leaf.shape[len(entry.fields) :]) * leaf.dtype.itemsize
        for idx, name in entry.names(leaf.shape):
            if max_shard_size is not None and plan[-1] and size + nbytes > max_shard_size:
                plan.append([])
                size = 0
            plan[-1].append((name, leaf_no, idx))
            size += nbytes
    files = (
        [SINGLE_FILE]
        if max_shard_size is None
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    if os.path.isdir(path):
        # from_hf reads the index if there is one, and the index lists its own shards: a
        # leftover index or shard would be read instead of, or mixed with, what is written.
        ours = set(files) | ({INDEX_FILE} if max_shard_size is not None else set())
        stale = sorted(
            f
            for f in os.listdir(path)
            if (f.endswith(".safetensors") or f == INDEX_FILE) and f not in ours
        )
        if stale:
            raise ValueError(
                f"to_hf: {path!r} already holds checkpoint file(s) {_listing(stale)} that this "
                "write would not replace, so the directory would mix two checkpoints. Write to "
                "an empty directory or remove them."
            )
    os.makedirs(path, exist_ok=True)
    weight_map, total, fetched_no, fetched = {}, 0, -1, np.empty(0)
    for file, items in zip(files, plan, strict=True):
        tensors = {}
        for name, leaf_no, idx in items:
            if fetched_no != leaf_no:  # one parameter (or stack) on the host at a time
                fetched_no, fetched = leaf_no, np.asarray(jax.device_get(leaves[leaf_no]))
            tensors[name] = table[paths[leaf_no]].to_hf(fetched[idx])
            weight_map[name] = file
            total += tensors[name].nbytes
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    if max_shard_size is not None:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(dict(config), f, indent=2, sort_keys=True)
