"""Cloud TPU slices by name, and the TPU compiler on a host without a TPU.

``TpuSlice.parse("v5e-8")`` turns a Cloud accelerator type (``v2-8``, ``v3-32``,
``v4-32``, ``v5e-1``/``v5litepod-16``, ``v5p-8``, ``v6e-4``, ...) into what JAX needs to
make that slice's devices without the hardware (``jax.experimental.topologies``: a
topology name such as ``"v5e:2x4"`` and its chip and host options) and what the
compiler's numbers are compared against: HBM and bf16 peak per JAX device.

Naming, as Cloud TPU names it: v2, v3, v4 and v5p count TensorCores (2 per chip); v5e
and v6e count chips. JAX shows each v2/v3 core as a device, and one device per chip on
v4/v5p (megacore) and v5e/v6e (one core). Hosts hold 4 chips (v5e/v6e: up to 8 in
one host for the -1, -4 and -8 slices).

With ``libtpu`` installed on a host that has no TPU, JAX would try to start the TPU
runtime at the first ``jax.devices()`` and libtpu prints metadata-query warnings;
:func:`quiet_on_cpu_host` (called when the package is imported) keeps JAX off the TPU
runtime there, gives libtpu the two settings it asks for, so nothing is printed, and lets
several processes load libtpu at once (its lock guards a TPU; there is none). On a TPU VM
it does nothing.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from .errors import UserError

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: ``name`` as in accelerator types, JAX's topology prefix, HBM and
    bf16 peak FLOP/s per JAX device, devices per chip, whether the type's number counts
    cores (2 per chip), whether its topologies are 3-D, and HBM bandwidth per chip. (Which
    generations take the Pallas kernel is ``layers.attention_dispatch.PALLAS_MIN_TPU_GENERATION``.)"""
    name: str
    topology_prefix: str
    hbm_bytes: int
    peak_bf16: float
    devices_per_chip: int
    counts_cores: bool
    three_d: bool
    single_host_chips: int  # the most chips one host holds
    chip_hbm_bandwidth: float  # bytes/s of one chip (Cloud TPU's published figure)


GENERATIONS = {g.name: g for g in (
    Generation("v2", "v2", 8 * GIB, 22.5e12, 2, True, False, 4, 0.7e12),
    Generation("v3", "v3", 16 * GIB, 61.5e12, 2, True, False, 4, 0.9e12),
    Generation("v4", "v4", 32 * GIB, 275e12, 1, True, True, 4, 1.2e12),
    Generation("v5p", "v5p", 95 * GIB, 459e12, 1, True, True, 4, 2.8e12),
    Generation("v5e", "v5e", 16 * GIB, 197e12, 1, False, False, 8, 0.82e12),
    Generation("v6e", "v6e", 32 * GIB, 918e12, 1, False, False, 8, 1.6e12),
)}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}

# JAX device_kind -> generation name (what a device or a topology's device reports)
DEVICE_KINDS = {"TPU v2": "v2", "TPU v3": "v3", "TPU v4": "v4", "TPU v4 lite": "v4",
                "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def _grid(chips: int, three_d: bool) -> tuple[int, ...]:
    """The chip grid of a slice, as Cloud TPU lays it out: 2-D from 1x1 (2x2, 2x4, 4x4,
    4x8, ...) or 3-D from 2x2x1 (2x2x2, 2x2x4, 2x4x4, 4x4x4, ...): the smallest side
    (the last of equal ones) doubles until the grid holds ``chips``."""
    dims = [2, 2, 1] if three_d else [1, 1]
    while math.prod(dims) < chips:
        i = max(j for j, d in enumerate(dims) if d == min(dims))
        dims[i] *= 2
    return tuple(dims)



def _offered(gen: Generation, chips: int) -> bool:
    """Whether Cloud TPU offers a ``gen`` slice of ``chips`` chips: a power of two, at
    least 4 chips (8 cores) where the type counts cores, and no 2-chip v5e/v6e."""
    if chips < 1 or chips & (chips - 1):
        return False
    return chips >= 4 if gen.counts_cores else chips != 2


def _type_number(gen: Generation, chips: int) -> int:
    """The number in the accelerator type: cores (2 per chip) or chips."""
    return chips * 2 if gen.counts_cores else chips


def _topology_name(gen: Generation, chips: int) -> str:
    return f"{gen.topology_prefix}:{'x'.join(map(str, _grid(chips, gen.three_d)))}"


def _topology_advice(gen: Generation, chips: int) -> str:
    """The topologies ``gen`` slices have (the smallest five) and the nearest to ``chips``."""
    sizes = [c for c in (2 ** k for k in range(12)) if _offered(gen, c)]
    listed = ", ".join(f"{_topology_name(gen, c)} (--tpu {gen.name}-{_type_number(gen, c)})"
                       for c in sizes[:5])
    if _offered(gen, chips):                  # the right size, laid out otherwise
        near = [chips]
    else:
        near = [c for c in sizes if c < chips][-1:] + [c for c in sizes if c > chips][:1]
    nearest = " or ".join(f"{_topology_name(gen, c)} ({c} chip{'s' * (c > 1)})" for c in near)
    return (f"{gen.name} slices are {listed}, ... (each side doubling in turn); "
            f"nearest: {nearest}")

@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU slice by its Cloud accelerator type; see the module docstring."""
    name: str
    generation: Generation
    chips: int
    topology: str
    chips_per_host: tuple[int, int, int] | None
    hosts: int

    @property
    def devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def hbm_bytes(self) -> int:
        """HBM of one JAX device."""
        return self.generation.hbm_bytes

    @property
    def peak_bf16(self) -> float:
        """bf16 peak FLOP/s of one JAX device."""
        return self.generation.peak_bf16

    @property
    def hbm_bandwidth(self) -> float:
        """HBM bytes/s of one JAX device (a v2/v3 core has half its chip's)."""
        return self.generation.chip_hbm_bandwidth / self.generation.devices_per_chip

    def next_larger(self) -> "TpuSlice":
        """The next larger slice of this generation (v5e-1 -> v5e-4, v4-8 -> v4-16)."""
        chips = self.chips * 2
        while not _offered(self.generation, chips):
            chips *= 2
        return self._of(self.generation, chips)

    def topology_kwargs(self) -> dict:
        kw = {}
        if self.generation.devices_per_chip == 1 and self.generation.counts_cores:
            kw["chip_config_name"] = "megacore"
        if self.chips_per_host is not None:
            kw["chips_per_host_bounds"] = self.chips_per_host
        return kw

    @classmethod
    def parse(cls, name: str) -> "TpuSlice":
        """``"v5e-8"`` -> the slice; a UserError names the valid forms."""
        m = re.fullmatch(r"\s*(v\d+[a-z]*)-(\d+)\s*", str(name).lower())
        known = ", ".join(f"{g}-N" for g in GENERATIONS)
        if m is None:
            raise UserError(f"--tpu {name!r} is not a TPU type; give a Cloud accelerator type "
                            f"such as v3-8, v4-32, v5e-1, v5litepod-8, v5p-8 or v6e-4 ({known})")
        gen_name = ALIASES.get(m.group(1), m.group(1))
        if gen_name not in GENERATIONS:
            raise UserError(f"--tpu {name!r}: unknown TPU generation {m.group(1)!r}; "
                            f"choose one of {sorted(GENERATIONS)} (v5litepod = v5e)")
        gen, number = GENERATIONS[gen_name], int(m.group(2))
        chips = number // 2 if gen.counts_cores else number
        if not _offered(gen, chips) or number != _type_number(gen, chips):
            sizes = "8, 16, 32, ..." if gen.counts_cores else "1, 4, 8, 16, ..."
            if not gen.counts_cores and chips == 2:
                raise UserError(f"--tpu {name!r}: {gen.name} slices come as -1, -4, -8, -16, ...")
            raise UserError(f"--tpu {name!r}: a {gen.name} slice has {sizes} "
                            f"{'cores' if gen.counts_cores else 'chips'} (a power of two"
                            f"{', at least 8' if gen.counts_cores else ''})")
        return cls._of(gen, chips)

    @classmethod
    def from_topology(cls, topology: str) -> "TpuSlice":
        """A slice from JAX's own topology name (``"v5e:2x4"``, ``"v4:2x2x4"``): one of the
        grids ``--tpu`` types lay out (:func:`_grid`); any other is a UserError that lists
        them and names the nearest."""
        m = re.fullmatch(r"\s*(v\d+[a-z]*):(\d+(?:x\d+){1,2})\s*", str(topology).lower())
        if m is None or ALIASES.get(m.group(1), m.group(1)) not in GENERATIONS:
            raise UserError(f"--topology {topology!r} is not a JAX TPU topology name; give "
                            "one such as v3:2x2, v4:2x2x4, v5e:2x4 or v6e:1x1")
        gen = GENERATIONS[ALIASES.get(m.group(1), m.group(1))]
        dims = tuple(int(x) for x in m.group(2).split("x"))
        chips = math.prod(dims)
        if not (_offered(gen, chips) and dims == _grid(chips, gen.three_d)):
            raise UserError(f"--topology {topology!r} is not a {gen.name} slice: "
                            + _topology_advice(gen, chips))
        return cls._of(gen, chips)

    @classmethod
    def _of(cls, gen: Generation, chips: int) -> "TpuSlice":
        """The slice of ``chips`` chips of ``gen`` (a count :func:`_offered` accepts)."""
        grid = _grid(chips, gen.three_d)
        per_host = None
        if chips <= gen.single_host_chips:      # one host holds the whole slice
            per_host = tuple(grid) + (1,) * (3 - len(grid))
        return cls(name=f"{gen.name}-{_type_number(gen, chips)}", generation=gen, chips=chips,
                   topology=_topology_name(gen, chips), chips_per_host=per_host,
                   hosts=1 if per_host else chips // 4)

    def jax_devices(self) -> list:
        """The slice's devices, made by the TPU compiler (libtpu) without the hardware."""
        quiet_on_cpu_host()
        import importlib.util
        if importlib.util.find_spec("libtpu") is None:
            raise UserError("compiling for a TPU needs the TPU compiler: pip install "
                            "'transformer_jax[tpu]' (libtpu, as jax[tpu] pins it)")
        from jax.experimental import topologies
        try:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=self.topology,
                                                **self.topology_kwargs())
        except Exception as e:  # noqa: BLE001 - JaxRuntimeError and the like, from libtpu
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()),
                         type(e).__name__)
            raise UserError(f"the TPU compiler cannot make topology {self.topology!r} "
                            f"({first[:300]}); give a --tpu type or one of its topologies: "
                            + _topology_advice(self.generation, self.chips)) from None
        return list(topo.devices)


def generation_of(device_kind: str) -> str | None:
    """``"TPU v3"`` -> ``"v3"``; None for a device kind that is no known TPU."""
    return DEVICE_KINDS.get(device_kind)


def _tpu_chips_present() -> bool:
    try:
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # noqa: BLE001 - JAX moved it: assume a TPU may be there, change nothing
        return True


def quiet_on_cpu_host() -> None:
    """On a host without TPU chips and with libtpu installed: no TPU runtime start at
    ``jax.devices()`` (it can only fail there, loudly), and libtpu's accelerator type and
    worker host set (it queries the metadata server for them and warns when it cannot).
    A TPU VM, or ``JAX_PLATFORMS`` naming ``tpu``, is left alone."""
    if "tpu" in os.environ.get("JAX_PLATFORMS", "") or _tpu_chips_present():
        return
    import importlib.util
    if importlib.util.find_spec("libtpu") is None:
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")   # any valid type quiets it;
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")       # topologies set their own
    # libtpu takes a host-wide lock (/tmp/libtpu_lockfile) that guards a TPU against two
    # processes; with no TPU it would only keep parallel compiles (test workers) apart
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:   # "tpu" stays a known platform (lowering rules register for it); its start fails
        from jax._src import xla_bridge   # quietly, as JAX's own CUDA start does without a GPU
        registration = xla_bridge._backend_factories.get("tpu")
        if registration is not None and not xla_bridge.backends_are_initialized():
            xla_bridge._backend_factories["tpu"] = dataclasses.replace(
                registration, factory=_no_tpu_here, fail_quietly=True)
    except Exception:  # noqa: BLE001 - JAX moved its internals: libtpu may warn, nothing worse
        pass


def _no_tpu_here():
    raise RuntimeError("this host has no TPU chips (transformer_jax.tpu.quiet_on_cpu_host)")
