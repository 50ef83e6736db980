"""How a training run spreads over devices and processes.

Processes. :func:`initialize` starts ``jax.distributed`` when the run has several
processes: explicit ``coordinator``/``num_processes``/``process_id`` (the CLI's
``--coordinator host:port --num-processes N --process-id i``, or the environment variables
``TRANSFORMER_JAX_COORDINATOR``, ``TRANSFORMER_JAX_NUM_PROCESSES``,
``TRANSFORMER_JAX_PROCESS_ID``), or a detected cluster: a multi-host Cloud TPU slice,
SLURM (``srun`` with several tasks) or Open MPI (``mpirun -n N``). On CPU the processes'
collectives go through gloo. Every process then runs the same program on its own
devices; each reads only its rows of every batch, process 0 alone writes logs, metrics,
samples and plots, and all processes save and restore the (sharded) checkpoints
together.

Devices. A :class:`Placement` says where the train state and the batches live, and so how
the step is compiled (``train/step.py``'s ``compile_train_step`` does it):

``jit`` (:class:`JitPlacement`, the default)
    A ``(data, fsdp, tensor)`` mesh (``--mesh``, default all devices on ``data``); the
    state is sharded by the logical-axis rules of :mod:`transformer_jax.sharding`, the
    global batch over ``data`` x ``fsdp``, and the step is one ``jax.jit`` with those
    in/out shardings and the state donated.
``pmap`` (:class:`PmapPlacement`)
    Classic data parallelism: the state replicated on every local device, each device
    takes ``global batch / devices`` rows, and ``jax.pmap`` sums the devices' loss sums
    and gradients (``lax.psum``) before dividing by the global weight - the same numbers
    as the jit path. Checkpoints and evaluation use the global, replicated form, so a
    pmap checkpoint resumes under jit on any mesh, and back.
"""
from __future__ import annotations

import abc
import json
import os
import sys
from typing import Any, Callable

import jax
import numpy as np

from .. import sharding as sh
from ..errors import UserError
from .step import full_params

ENV_COORDINATOR = "TRANSFORMER_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "TRANSFORMER_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "TRANSFORMER_JAX_PROCESS_ID"


# ----------------------------------------------------------------------------- processes

def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def detect_cluster() -> str | None:
    """The name of a detected multi-process launch environment, or None.

    ``"slurm"`` (``srun`` with more than one task), ``"mpi"`` (``mpirun -n N``, N > 1) or
    ``"tpu"`` (a Cloud TPU VM slice with more than one host, from the TPU runtime's
    environment or the VM metadata).
    """
    if "SLURM_JOB_ID" in os.environ and (_int_env("SLURM_NTASKS") or _int_env("SLURM_NPROCS") or 1) > 1:
        return "slurm"
    if (_int_env("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "mpi"
    hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES")
    if hosts and len(hosts.split(",")) > 1:
        return "tpu"
    try:   # a GCE TPU VM: ask the metadata server through JAX's own cluster detection
        from jax._src import cloud_tpu_init
        from jax._src.clusters import cloud_tpu_cluster
        if cloud_tpu_init.running_in_cloud_tpu_vm and cloud_tpu_cluster.GceTpuCluster.is_env_present():
            if cloud_tpu_cluster.GceTpuCluster.get_process_count() > 1:
                return "tpu"
    except Exception:   # not on a TPU VM, or JAX moved its internals: no auto-detection
        pass
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Start ``jax.distributed`` if this run has several processes; True if it did (or
    already had). Call it before anything touches the devices. See the module docstring."""
    if jax.distributed.is_initialized():
        return True
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _int_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _int_env(ENV_PROCESS_ID)
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    cluster = detect_cluster()
    if explicit:
        if num_processes is not None and num_processes < 1:
            raise UserError(f"--num-processes must be >= 1, got {num_processes}")
        if num_processes == 1 and cluster is None:
            return False
        if cluster is None:
            missing = [flag for flag, v in (("--coordinator host:port", coordinator),
                                            ("--num-processes N", num_processes),
                                            ("--process-id i", process_id)) if v is None]
            if missing:
                raise UserError("a multi-process run needs --coordinator host:port, "
                                "--num-processes N and --process-id i on every process "
                                f"(or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); "
                                f"missing: {', '.join(missing)}")
            if not 0 <= process_id < num_processes:
                raise UserError(f"--process-id {process_id} is not in [0, {num_processes})")
            if ":" not in coordinator:
                raise UserError(f"--coordinator {coordinator!r} must be host:port "
                                "(the address of process 0, e.g. 10.0.0.2:8476)")
    elif cluster is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    return True


def is_main() -> bool:
    return jax.process_index() == 0


def warn(message: str) -> None:
    """``warning: message`` on stderr, from process 0 only."""
    if is_main():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def barrier(name: str) -> None:
    """Block until every process reaches the barrier ``name`` (a no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def main_first(fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` on process 0 first, then on the others: one-time preparation that writes
    files (a dataset build, a tokenizer trained into a shared workdir) is done once and the
    other processes find it done."""
    if not is_main():
        barrier(name)
    try:
        return fn()
    finally:   # also on an error, so that the others do not wait forever (they fail the same way)
        if is_main():
            barrier(name)


def any_process(flag: bool) -> bool:
    """True on every process if ``flag`` is true on any (a collective: call it everywhere)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array([bool(flag)], np.int32))))


def _encode(obj: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)


def allgather_json(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable ``obj``, in process order (a collective)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils
    data = _encode(obj)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: data.size] = data
    every = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(every, sizes)]


def broadcast_json(obj: Any) -> Any:
    """Process 0's JSON-serialisable ``obj`` on every process (a collective)."""
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils
    data = _encode(obj) if is_main() else np.zeros(0, np.uint8)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array(data.size, np.int32))))
    buf = np.zeros(size, np.uint8)
    if is_main():
        buf[:] = data
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return json.loads(bytes(out).decode())


def merge_data_states(states: list[dict]) -> dict:
    """One checkpointable dict for the processes' data-iterator positions: the position
    itself when all are equal (memory mode: it does not depend on the process), else
    ``{"per_process": [...]}`` (stream mode: each process reads its own documents)."""
    return states[0] if all(s == states[0] for s in states) else {"per_process": list(states)}


def gather_data_state(state: dict) -> dict:
    """:func:`merge_data_states` of every process's ``state`` (a collective)."""
    return merge_data_states(allgather_json(state))


def local_data_state(saved: dict, index: int | None = None, count: int | None = None) -> dict:
    """Process ``index``'s (default: this process's) entry of a :func:`merge_data_states` dict."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if "per_process" not in saved:
        return saved
    states = saved["per_process"]
    if len(states) != count:
        raise UserError(f"the checkpoint's data position was saved by {len(states)} processes "
                        f"reading separate shards; this run has {count}. Resume with "
                        f"{len(states)} processes (the mesh and the devices per process may change)")
    return states[index]


# ----------------------------------------------------------------------------- placements

def _adjusted(params, adjust: Callable[[Any], Any]) -> tuple[Any, bool]:
    """``(adjust(params), whether any leaf changed)`` (also if ``adjust`` edits in place)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    new = adjust(params)
    new_leaves, new_treedef = jax.tree_util.tree_flatten(new)
    same = new_treedef == treedef and all(a is b for a, b in zip(leaves, new_leaves))
    return new, not same


def _adjusted_state(state, adjust: Callable[[Any], Any], split: Any):
    """``(state with adjust(params), whether any parameter changed)``. With a ``split``
    (fine-tuning adapters: ``split.join`` / ``split.split``, train/finetune.py) ``adjust``
    sees the whole parameter tree, frozen kernels stored quantized read back first, and the
    result is split again. When something changed the optimizer state is stale: re-init it."""
    if state.frozen is None or split is None:
        params, changed = _adjusted(state.params, adjust)
        return state.replace(params=params), changed
    whole, changed = _adjusted(jax.jit(split.join)(state.params, state.frozen), adjust)
    if not changed:
        return state, False
    trainable, frozen = jax.jit(split.split)(whole)   # compiled: NF4 op by op is slow
    return state.replace(params=trainable, frozen=frozen), True


def _placed(batch) -> bool:
    """Whether a batch's leaves are device arrays already (from ``put_batch``)."""
    return all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(batch))


class Placement(abc.ABC):
    """Where the train state and batches live, and how steps are compiled. Subclasses:
    :class:`JitPlacement`, :class:`PmapPlacement`; build one with :func:`make_placement`."""
    parallelism: str = ""
    axis_name: str | None = None   # the mapped axis the train step must psum over (pmap)
    mesh: jax.sharding.Mesh        # the mesh of checkpoints and evaluation
    data_index: int = 0            # this process reads rows [i*B/n, (i+1)*B/n) of each batch
    data_count: int = 1
    notes: list[str]

    def __init__(self, global_batch: int):
        self.global_batch = global_batch
        self.notes = []
        self._abstract = self._shardings = None

    # -- state -----------------------------------------------------------------
    def setup(self, create_state: Callable[[], Any], init_variables: Callable[[], Any]) -> None:
        """Work out the state's shapes and global shardings (no computation)."""
        self._abstract, self._shardings, self.notes = sh.train_state_shardings(
            create_state, init_variables, self.mesh)

    def restore_target(self) -> Any:
        """Abstract state with the shardings a restored checkpoint should take here."""
        return sh.with_shardings(self._abstract, self._shardings)

    @abc.abstractmethod
    def init_state(self, create_state: Callable[[], Any], tx, adjust_params: Callable[[Any], Any],
                   split: Any = None):
        """The initial train state, placed (and sharded) for this strategy.

        ``adjust_params`` edits the whole fresh parameter tree (a pretrained start); with
        a ``split`` (fine-tuning adapters) the result is split again into what trains and
        what stays frozen (``split``: a :class:`~transformer_jax.train.finetune.ParamSplit`)."""

    @abc.abstractmethod
    def init_frozen_state(self, create_trainable: Callable[[], Any], frozen: Any):
        """The initial train state of a start whose frozen part is given whole (a QLoRA
        base streamed stored, ``finetune.Start.frozen_params``): ``create_trainable()``
        builds the state without it (``frozen`` None), compiled so that only the leaves
        it returns are computed (the rest of the init is dead code), and ``frozen`` goes
        in as it is, moved onto the state's shardings."""

    def from_checkpoint(self, state):
        return state

    def to_checkpoint(self, state):
        """The state as global arrays (what orbax saves)."""
        return state

    def step_of(self, state) -> int:
        return int(jax.device_get(state.step))

    def eval_params(self, state):
        """Parameters (trainable and frozen) as global arrays on :attr:`mesh`, for the
        jitted eval step."""
        return full_params(state)

    def local_params(self, state):
        """Parameters that process-local code (sampling, decoding metrics) can use. With
        several processes this gathers them (a collective: call it on every process)."""
        if jax.process_count() == 1:
            return full_params(state)
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(full_params(state), tiled=True)

    # -- steps (compiled by ``step.compile_train_step``) --------------------------
    @property
    def state_shardings(self) -> Any:
        """The train state's global shardings, worked out by :meth:`setup`."""
        return self._shardings

    def placed(self, batch):
        """``batch`` on the devices: as given when it is already there (a prefetched batch),
        else this process's host rows through :meth:`put_batch`."""
        return batch if _placed(batch) else self.put_batch(batch)

    def put_batch(self, batch):
        """This process's host rows -> global arrays split over the batch axes of :attr:`mesh`
        (asynchronous: a loop can place the next batches while a step runs)."""
        return sh.shard_batch(batch, self.mesh, self.global_batch)

    def eval_fn(self, fn: Callable) -> Callable:
        """``run(params, host_batch)`` for an eval function of (params, batch) -> scalars."""
        jitted = jax.jit(fn, out_shardings=sh.replicated(self.mesh))

        def run(params, host_batch):
            batch = sh.shard_batch(host_batch, self.mesh,
                                   len(jax.tree_util.tree_leaves(host_batch)[0]) * self.data_count)
            with sh.use_mesh(self.mesh):
                return jitted(params, batch)
        return run

    def describe(self) -> str:
        return f"{self.parallelism} over {jax.device_count()} device(s), mesh {sh.describe(self.mesh)}"


class JitPlacement(Placement):
    parallelism = "jit"

    def __init__(self, mesh_spec, global_batch: int, accum_steps: int = 1):
        super().__init__(global_batch)
        self.mesh = sh.make_mesh(mesh_spec)
        split = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        micro = global_batch // accum_steps
        if micro % split:
            raise UserError(
                f"batch_size={global_batch} (accum_steps={accum_steps}: micro-batches of {micro} "
                f"rows) does not split over the mesh's data x fsdp = {split} devices "
                f"(mesh {sh.describe(self.mesh)}); use a batch_size that is a multiple of "
                f"{split * accum_steps}")
        self.data_index, self.data_count = sh.process_rows(self.mesh, global_batch)

    def init_state(self, create_state, tx, adjust_params, split=None):
        state = jax.jit(create_state, out_shardings=self._shardings)()
        state, changed = _adjusted_state(state, adjust_params, split)
        if changed:
            params = sh.put_global(state.params, self._shardings.params)
            frozen = (None if state.frozen is None
                      else sh.put_global(state.frozen, self._shardings.frozen))
            opt_state = jax.jit(tx.init, out_shardings=self._shardings.opt_state)(params)
            state = state.replace(params=params, frozen=frozen, opt_state=opt_state)
        return state

    def init_frozen_state(self, create_trainable, frozen):
        state = jax.jit(create_trainable, out_shardings=self._shardings.replace(frozen=None))()
        return state.replace(frozen=sh.put_global(frozen, self._shardings.frozen))


class PmapPlacement(Placement):
    parallelism = "pmap"
    axis_name = "batch"

    def __init__(self, mesh_spec, global_batch: int, accum_steps: int = 1):
        super().__init__(global_batch)
        n = jax.device_count()
        given = sh.parse_mesh(mesh_spec)
        if given and sh.mesh_shape(given, n) != {"data": n, "fsdp": 1, "tensor": 1}:
            raise UserError(f"--parallelism pmap is data parallelism over all {n} devices; "
                            f"mesh {mesh_spec!r} shards more than the batch. Drop --mesh, or use "
                            "--parallelism jit for fsdp/tensor meshes")
        self.mesh = sh.make_mesh(None)
        local = jax.local_device_count()
        procs = jax.process_count()
        if global_batch % (procs * local) or (global_batch // (procs * local)) % accum_steps:
            raise UserError(f"batch_size={global_batch} does not split into {procs * local} "
                            f"devices x accum_steps={accum_steps} equal micro-batches; use a "
                            f"multiple of {procs * local * accum_steps}")
        self.data_index, self.data_count = jax.process_index(), procs

    def init_state(self, create_state, tx, adjust_params, split=None):
        state = jax.jit(create_state)()
        state, changed = _adjusted_state(state, adjust_params, split)
        if changed:
            state = state.replace(opt_state=jax.jit(tx.init)(state.params))
        return sh.pmap_replicate(state)

    def init_frozen_state(self, create_trainable, frozen):
        return sh.pmap_replicate(jax.jit(create_trainable)().replace(frozen=frozen))

    def from_checkpoint(self, state):
        return sh.pmap_replicate(state)

    def to_checkpoint(self, state):
        return sh.pmap_to_global(state, self.mesh)

    def step_of(self, state) -> int:
        return int(jax.device_get(sh.pmap_local(state.step)))

    def eval_params(self, state):
        return sh.pmap_to_global(full_params(state), self.mesh)

    def local_params(self, state):
        return sh.pmap_local(full_params(state))

    def put_batch(self, batch):
        """Host rows -> (local devices, rows per device, ...) arrays, slice i on device i
        (the layout ``jax.pmap`` reads without moving anything)."""
        devices = jax.local_devices()
        sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("device",)),
                                              jax.sharding.PartitionSpec("device"))
        return jax.tree_util.tree_map(
            lambda x: jax.device_put(np.asarray(x).reshape((len(devices), -1) + np.shape(x)[1:]),
                                     sharding), batch)

    def describe(self) -> str:
        return f"pmap over {jax.device_count()} device(s) ({jax.process_count()} process(es))"


PLACEMENTS = {"jit": JitPlacement, "pmap": PmapPlacement}


def make_placement(parallelism: str, mesh_spec, global_batch: int, accum_steps: int = 1) -> Placement:
    if parallelism not in PLACEMENTS:
        raise UserError(f"unknown parallelism {parallelism!r}; choose 'jit' or 'pmap'")
    return PLACEMENTS[parallelism](mesh_spec, global_batch, accum_steps)
