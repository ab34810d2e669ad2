"""Runs that span several processes (hosts): `jax.distributed`, started before JAX's
backends, with every wait bounded.

One process per host runs the same command; together they form one JAX program over the
global device list (`jax.devices()` after `initialize`), so `--devices` and `--mesh` mean the
same on one process or many. On a Cloud TPU slice with several workers the processes find
each other from the TPU metadata (`jax.distributed.initialize()` with no arguments);
elsewhere each gets `--coordinator HOST:PORT --num-processes N --process-id I` (on CPU each
makes `devices / N` fake devices and talks to the others over gloo).

Failure is bounded. A coordinator that never answers, or processes that never all join,
end `initialize` after `--init-timeout` seconds; a peer that dies or hangs mid-run is
noticed by [`PeerWatch`][] (a heartbeat through the distributed key-value store) after
`--peer-timeout` seconds, and the survivors exit with [`EXIT_PEER_LOST`][] and one line
saying which process was lost. JAX's own heartbeat (which aborts the process with a C++
log) is set later than ours, as a backstop. Process 0 is special: it hosts the coordination
service, and when it dies JAX's client in every other process notices at once (its error
poll fails) and aborts the process with JAX's fatal log ("Terminating process because the
JAX distributed service detected fatal errors ... the leader task was preempted/died"), a
status from SIGABRT; that happens before any watch of ours can speak, and JAX (0.10) offers
no hook to replace it.
"""

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ._exit import die
from ._processes import PREFIX, exchange, kv_client

EXIT_PEER_LOST = 3
"""Exit status of a process that stops because another process of its run failed, hung
or died, or the coordinator became unreachable."""


PEER_TIMEOUT = 60
"""Default `--peer-timeout`: seconds without a heartbeat after which a peer is lost."""

HEARTBEAT_INTERVAL = 1.0
# JAX's heartbeat (which aborts with a C++ log and no message of ours) comes after ours.
_JAX_HEARTBEAT_MARGIN = 30


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins a multi-process run.

    - `coordinator`: `HOST:PORT` of process 0's coordination service, or `None` when
      `jax.distributed` finds it (Cloud TPU).
    - `num_processes`, `process_id`: the run's process count and this process's index.
    """

    coordinator: str | None
    num_processes: int
    process_id: int

    def describe(self) -> str:
        where = self.coordinator or "from the Cloud TPU metadata"
        me = f"process {self.process_id}" if self.process_id >= 0 else "this process"
        return f"{me} of {self.num_processes} (coordinator {where})"


def cluster_from_flags(
    coordinator: str | None, num_processes: int | None, process_id: int | None, devices: int
) -> Cluster | None:
    """The multi-process setting of a run, from its flags or the Cloud TPU environment.

    **Arguments:**

    - `coordinator`, `num_processes`, `process_id`: `--coordinator HOST:PORT`,
      `--num-processes N`, `--process-id I`: all three or none.
    - `devices`: `--devices`, the global device count; split evenly over the processes.

    **Returns:** a [`Cluster`][], or `None` for a single-process run (no flags and not a
    Cloud TPU slice of several workers).

    **Raises:** `ValueError` naming the rule for flags given partly, a process count below
    1, a process id out of range, a coordinator that is not `HOST:PORT`, or devices that do
    not split evenly over the processes.
    """
    given = {
        "--coordinator": coordinator,
        "--num-processes": num_processes,
        "--process-id": process_id,
    }
    missing = [k for k, v in given.items() if v is None]
    if len(missing) == 3:
        workers = tpu_worker_count()
        if workers <= 1:
            return None
        return Cluster(None, workers, -1)  # process id: from the TPU metadata, at start
    if missing:
        raise ValueError(
            "a multi-process run needs --coordinator HOST:PORT, --num-processes N and "
            f"--process-id I together; got {_shown(given)}, missing {', '.join(missing)}. "
            "Pass all three (the same --coordinator and --num-processes on every process, "
            "--process-id 0..N-1), or none for one process (or a Cloud TPU slice)."
        )
    assert coordinator is not None and num_processes is not None and process_id is not None
    if num_processes < 1:
        raise ValueError(
            f"--num-processes must be at least 1; got --num-processes {num_processes}. Pass "
            "the number of processes (hosts) of the run."
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id must lie in 0..num_processes-1 = 0..{num_processes - 1}; got "
            f"--process-id {process_id}. Give each process a distinct id from that range."
        )
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--coordinator must be HOST:PORT with a port in 1..65535 (process 0's host, "
            f"where it serves the other processes); got --coordinator {coordinator!r}. Pass "
            "e.g. --coordinator 10.0.0.2:8476."
        )
    if devices % num_processes:
        raise ValueError(
            f"--devices is the global device count and must split evenly over the processes; "
            f"got --devices {devices} and --num-processes {num_processes}. Pass --devices "
            f"{num_processes * max(1, devices // num_processes)} (a multiple of "
            f"{num_processes})."
        )
    if num_processes == 1:
        return None
    return Cluster(coordinator, num_processes, process_id)


def _shown(given: dict[str, Any]) -> str:
    shown = [f"{k} {v}" for k, v in given.items() if v is not None]
    return " ".join(shown) or "none"


def tpu_worker_count() -> int:
    """**Returns:** the number of workers (hosts) of the Cloud TPU slice this process runs
    on, from the environment (GKE) or the VM's metadata (GCE); 1 elsewhere, or when they
    cannot be read (a single-host TPU such as Colab's)."""
    from .._compat import cloud_tpu_process_count, running_in_cloud_tpu_vm

    if not running_in_cloud_tpu_vm():
        return 1
    try:
        return cloud_tpu_process_count() or 1
    except Exception:  # no metadata server (e.g. Colab): one host
        return 1


def is_tpu_host() -> bool:
    """**Returns:** whether this host has TPU chips (JAX's Cloud TPU detection)."""
    from .._compat import running_in_cloud_tpu_vm

    return running_in_cloud_tpu_vm()


class _Deadline:
    """Exit the process with one clear line when a blocking call overruns `seconds`
    (JAX's own timeouts abort with a C++ stack trace instead)."""

    def __init__(self, seconds: float, message: Callable[[], str], code: int):
        self._done = threading.Event()
        self._seconds, self._message, self._code = seconds, message, code
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if not self._done.wait(self._seconds):
            die(self._message(), self._code)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()


def _reachable(coordinator: str) -> str:
    host, _, port = coordinator.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
    except socket.gaierror as e:
        return f"cannot resolve host {host!r} ({e})"
    except OSError as e:
        return f"nothing accepts connections at {coordinator} ({e.strerror or e})"
    return ""


def start_processes(
    cluster: Cluster, *, devices: int, init_timeout: int, peer_timeout: int
) -> "Runtime":
    """Join the multi-process run: set the CPU devices and gloo (off TPU), then
    `jax.distributed.initialize`, bounded by `init_timeout`.

    Must run before JAX creates its backends (before the first array).

    **Arguments:**

    - `cluster`: from [`cluster_from_flags`][].
    - `devices`: the global device count; on CPU each process makes `devices /
      num_processes`.
    - `init_timeout`: seconds to wait for the coordinator and every process to join; past
      that the process prints why and exits with status 2.
    - `peer_timeout`: see [`PeerWatch`][]; JAX's own heartbeat gets a longer bound.

    **Returns:** the [`Runtime`][] of this process, its [`PeerWatch`][] running.
    """
    import jax

    if not is_tpu_host():
        set_cpu_devices(devices // cluster.num_processes)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def message() -> str:
        n, why = cluster.num_processes, ""
        if cluster.coordinator is not None and cluster.process_id != 0:
            why = _reachable(cluster.coordinator)
        if why:
            return (
                f"{cluster.describe()} could not reach the coordinator within --init-timeout "
                f"{init_timeout} s: {why}. Start process 0 with the same "
                "--coordinator (its own host and a free port), check the address and that "
                "the port is open between the hosts, or raise --init-timeout."
            )
        return (
            f"{cluster.describe()}: not all {n} processes joined the run within "
            f"--init-timeout {init_timeout} s. Start every process with the same "
            f"--coordinator and --num-processes {n} and a distinct --process-id in "
            f"0..{n - 1}, or raise --init-timeout."
        )

    kwargs: dict[str, Any] = {}
    if cluster.coordinator is not None:
        kwargs = dict(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
        )
    with _Deadline(init_timeout, message, code=2):
        jax.distributed.initialize(
            **kwargs,
            initialization_timeout=init_timeout + _JAX_HEARTBEAT_MARGIN,
            heartbeat_timeout_seconds=peer_timeout + _JAX_HEARTBEAT_MARGIN,
            shutdown_timeout_seconds=peer_timeout + _JAX_HEARTBEAT_MARGIN,
        )
    cluster = dataclasses.replace(
        cluster, num_processes=jax.process_count(), process_id=jax.process_index()
    )
    runtime = Runtime(cluster, kv_client(), timeout=init_timeout)
    runtime.watch = PeerWatch(runtime, peer_timeout)
    runtime.watch.start()
    return runtime


def set_cpu_devices(n: int) -> None:
    """Ask for `n` CPU devices in this process; possible only before JAX creates its
    backends (else the [`Placement`][] reports the count it found)."""
    import jax

    current = jax.config.jax_num_cpu_devices  # pyright: ignore[reportAttributeAccessIssue]
    if n <= 1 or current >= n:
        return
    flag = f"--xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f] + [flag]
    )
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already exist (e.g. inside a notebook); the Trainer checks the count


class Runtime:
    """This process's handle on a multi-process run: its id, the key-value store, barriers.

    **Arguments:**

    - `cluster`: the run's [`Cluster`][] (its ids as JAX reports them).
    - `client`: `jax.distributed`'s client.
    - `timeout`: seconds any exchange or barrier may wait for the other processes.
    """

    def __init__(self, cluster: Cluster, client, timeout: float):
        self.cluster, self.client, self.timeout = cluster, client, timeout
        self.watch: PeerWatch | None = None

    @property
    def process_id(self) -> int:
        return self.cluster.process_id

    @property
    def num_processes(self) -> int:
        return self.cluster.num_processes

    def check_same_flags(self, flags: dict[str, Any]) -> None:
        """Check that every process was started with the same flags.

        **Arguments:**

        - `flags`: this process's flags, JSON-serialisable (leave out `--process-id`).

        **Raises:** `ValueError` naming each flag where a process differs
        from process 0 (the same message on every process).
        """
        mine = json.dumps(flags, sort_keys=True, default=str)
        records = [json.loads(v) for v in exchange("flags", mine, self.timeout)]
        first, diffs = records[0], []
        for p, record in enumerate(records[1:], start=1):
            for key in sorted(set(first) | set(record)):
                if first.get(key) != record.get(key):
                    flag = "--" + key.replace("_", "-")
                    diffs.append(
                        f"{flag}: process 0 has {first.get(key)!r}, process {p} has "
                        f"{record.get(key)!r}"
                    )
        if diffs:
            shown = "; ".join(diffs[:6]) + ("; ..." if len(diffs) > 6 else "")
            raise ValueError(
                "every process of a run must be started with the same flags (only "
                f"--process-id differs); got {len(diffs)} difference(s): {shown}. Start all "
                "processes with the same command line."
            )

    def finish(self) -> None:
        """Say this process ended normally (peers stop watching it) and stop watching."""
        self._post("done", "1")
        if self.watch is not None:
            self.watch.stop()

    def fail(self, message: str, grace: float = 2 * HEARTBEAT_INTERVAL) -> None:
        """Tell the peers this process is stopping because of `message`, and give their
        watch a moment to read it."""
        if self.watch is not None:
            self.watch.stop()
        if self._post("failed", " ".join(message.split())[:2000]):
            time.sleep(grace)

    def _post(self, kind: str, value: str) -> bool:
        try:
            key = f"{PREFIX}/watch/{kind}/{self.process_id}"
            self.client.key_value_set(key, value, allow_overwrite=True)
            return True
        except Exception:  # the coordinator is gone: nobody to tell
            return False


class PeerWatch(threading.Thread):
    """Ends this process when another process of the run is lost.

    Every `interval` seconds it publishes this process's heartbeat counter in the key-value
    store and reads the others'. It calls `_exit.die` with [`EXIT_PEER_LOST`][] and one line
    naming the process when a peer's counter has not moved for `timeout` seconds (it died,
    hung or lost its network), when a peer reports an error ([`Runtime.fail`][]), or when
    the coordinator (process 0) has not answered for `min(timeout, 15)` seconds. A peer
    that finished normally ([`Runtime.finish`][]) is no longer watched.

    The heartbeat is a Python thread: it keeps beating while the main thread computes,
    compiles or waits in a collective (they release the GIL).
    """

    def __init__(self, runtime: Runtime, timeout: float, interval: float = HEARTBEAT_INTERVAL):
        super().__init__(daemon=True, name="eqx-longctx-peer-watch")
        self.runtime, self.timeout, self.interval = runtime, timeout, interval
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        rt = self.runtime
        me, client = rt.process_id, rt.client
        peers = [p for p in range(rt.num_processes) if p != me]
        last = {p: ("", time.monotonic()) for p in peers}
        count, unreachable_since = 0, None
        where = f"{PREFIX}/watch/"
        while not self._stop_event.wait(self.interval):
            count += 1
            now = time.monotonic()
            try:
                client.key_value_set(f"{where}alive/{me}", str(count), allow_overwrite=True)
                entries = client.key_value_dir_get(where)
            except Exception as e:
                unreachable_since = unreachable_since or now
                if now - unreachable_since >= min(self.timeout, 15):
                    self._lost(
                        f"lost contact with the coordinator (process 0"
                        f"{' at ' + rt.cluster.coordinator if rt.cluster.coordinator else ''}"
                        f") for {now - unreachable_since:.0f} s: it died or the network "
                        f"failed ({str(e).splitlines()[0]})"
                    )
                continue
            if self._stop_event.is_set():
                return
            unreachable_since = None
            state: dict[str, dict[int, str]] = {"alive": {}, "failed": {}, "done": {}}
            for key, value in entries:
                kind, _, pid = key[len(where) :].partition("/")
                if kind in state and pid.isdigit():
                    state[kind][int(pid)] = value
            for p, message in sorted(state["failed"].items()):
                if p != me:
                    self._lost(f"process {p} of the run failed: {message}")
            for p in peers:
                if p in state["done"]:
                    continue
                beat = state["alive"].get(p, "")
                if beat != last[p][0]:
                    last[p] = (beat, now)
                elif now - last[p][1] > self.timeout:
                    self._lost(
                        f"process {p} sent no heartbeat for --peer-timeout {self.timeout} s: "
                        "it died, hung or lost its network (its own log may say why)"
                    )

    def _lost(self, why: str) -> None:
        rt = self.runtime
        die(
            f"process {rt.process_id} of {rt.num_processes} stops: {why}. The run's newest "
            "complete checkpoint is intact; restart every process with the same flags plus "
            "--resume.",
            EXIT_PEER_LOST,
        )
