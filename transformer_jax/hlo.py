"""What one run of a compiled XLA program does, read from its HLO text (``compiled.as_text()``).

XLA's own ``compiled.cost_analysis()`` counts a while loop's body once: a model whose layers
are scanned (``scan_layers``) has its layers' FLOPs and bytes counted as one layer. Here every
instruction counts once per execution of its computation, a while loop's body as often as
its trip count (XLA's known count, or the ``i < N`` bound of its condition):

* :func:`collectives`: the collectives per device, count and bytes (async pairs at their
  ``-start``);
* :func:`costs`: FLOPs (matmuls: ``dot`` and ``convolution``, wherever fused; the Mosaic
  flash-attention kernels from their Q and K shapes, :data:`MOSAIC_MATMULS`, the NF4
  matmul kernels from their rows and packed codes, :data:`NF4_MATMULS`; elementwise
  work not counted) and HBM bytes (each top-level instruction's operands and results, as
  XLA's cost analysis counts them: a fusion's inputs read, its outputs written; a dynamic
  slice reads only its slice, in a fusion also through a change of tiling or a nested
  fusion; a dynamic update writes only its update, and its buffer, updated in place, is not
  read; a slice, an async slice or an async copy moves its slice or its operand once;
  arrays the compiler placed in VMEM, memory space ``S(1)``, and bookkeeping ops move no
  HBM bytes).
"""
from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# the Mosaic flash-attention kernels (layers/flash_attention.py): T x S matmuls per call
# (forward: Q K^T, P V; dK/dV: recomputed Q K^T, dO V^T, P^T dO, dS^T Q; dQ: Q K^T, dO V^T,
# dS K; dbias: Q K^T, dO V^T), each 2 B N T S H FLOPs with Q (B, N, T, H) and K (.., S, H)
# JAX's splash kernels (layers/splash_attention.py; named splash_{mha,mqa}_{fwd,dkv,dq}...)
# the same by phase; their Q and K follow the scalar-prefetch operands (the mask tables)
MOSAIC_MATMULS = {"flash_attention_fwd": 2, "flash_attention_dkdv": 4,
                  "flash_attention_dq": 3, "flash_attention_dbias": 2,
                  "splash_fwd": 2, "splash_dkv": 4, "splash_dq": 3}
# the NF4 matmul kernels (layers/quant_matmul.py): x (M, K) or dy's even columns (M, N2)
# first, the packed codes (K, N2) uint8 among the operands; 2 M K N FLOPs with N = 2 N2
NF4_MATMULS = ("nf4_matmul", "nf4_matmul_dx")
# instructions that move no data (or whose data moves in the computations they call)
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
        "conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "iota",
        "copy-done", "all-gather-done", "all-reduce-done", "collective-permute-done",
        "send-done", "recv-done", "async-done", "add-dependency", "domain"}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"(?:body|calls|to_apply|branch_computations|true_computation|"
                     r"false_computation)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_DTYPES = ("pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2")
_SHAPE = re.compile(rf"\b({_DTYPES})\[([\d,]*)\]")
_ARRAY = re.compile(rf"\b({_DTYPES})\[([\d,]*)\](\{{[^{{}}]*(?:\([^)]*\))*[^{{}}]*\}})?")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
          "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
          "f8e4m3fn": 1, "f8e5m2": 1}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")


def _dims(dims: str) -> list[int]:
    return [int(d) for d in dims.split(",") if d]


def result_bytes(result: str, start: bool = False) -> int:
    """Bytes of an instruction's result type: every array of a tuple (a combined
    collective), or the last one of an async ``-start`` (its tuple also holds the operand)."""
    arrays = _SHAPE.findall(result)
    return sum(int(math.prod(_dims(d)) * _BYTES[t]) for t, d in (arrays[-1:] if start else arrays))


def _hbm_bytes(result: str) -> int:
    """Bytes of the arrays of a type that live in HBM (not in VMEM, ``S(1)`` in the layout)."""
    return sum(int(math.prod(_dims(d)) * _BYTES[t]) for t, d, layout in _ARRAY.findall(result)
               if "S(1)" not in layout)


class Program:
    """An HLO module's computations: ``{name: [instruction lines]}`` and the entry's name."""

    def __init__(self, hlo_text: str):
        self.comps: dict[str, list[str]] = {}
        self._types: dict[str, dict[str, str]] = {}
        self._users: dict[str, dict[str, list[tuple]]] = {}
        self._lines: dict[str, dict[str, str]] = {}
        self.entry, name = None, None
        for line in hlo_text.splitlines():
            m = _COMPUTATION.match(line) if line[:1].strip() else None   # headers: unindented
            if m and not line.startswith("HloModule"):
                name = m.group(1)
                self.comps[name] = []
                if line.startswith("ENTRY"):
                    self.entry = name
            elif name is not None and line.strip() and line.strip() != "}":
                self.comps[name].append(line)

    def trip_count(self, line: str) -> int:
        """How often a while loop runs: XLA's known trip count, else the bound of its
        condition (``i < N`` with a constant N, as a scan over layers compiles), else 1."""
        known = _TRIP.search(line)
        if known:
            return int(known.group(1))
        cond = re.search(r"condition=%?([\w.\-]+)", line)
        body = self.comps.get(cond.group(1), []) if cond else []
        constant = re.compile(r"s32\[\]\S* constant\((\d+)\)")
        bounds = [int(m.group(1)) for ln in body for m in [constant.search(ln)] if m]
        return bounds[0] if len(bounds) == 1 and any("direction=LT" in ln for ln in body) else 1

    def callees(self, line: str, comp: str) -> list[str]:
        return [c for group in _CALLEE.findall(line) for c in re.split(r",\s*%?", group)
                if c in self.comps and c != comp]

    def total(self, count, comp: str | None = None, stack: tuple = (), memo=None) -> dict:
        """``{key: sum}`` of ``count(line, comp, program)`` (a dict per instruction) over one
        run of the program: called computations once per call, loop bodies times their trip
        count, a conditional as its largest branch. ``count`` returning None for a line
        skips its callees."""
        comp = self.entry if comp is None else comp
        memo = {} if memo is None else memo
        if comp in memo:
            return memo[comp]
        out: dict = {}
        for line in self.comps.get(comp, ()):
            own = count(line, comp, self)
            for k, v in (own or {}).items():
                out[k] = out.get(k, 0) + v
            if own is None:
                continue
            trips = self.trip_count(line) if re.search(r"\swhile\(", line) else 1
            called = [self.total(count, c, stack + (comp,), memo)
                      for c in self.callees(line, comp) if c not in stack]
            if called and re.search(r"\sconditional\(", line):    # one branch runs: the most
                called = [{k: max(c.get(k, 0) for c in called) for c in called for k in c}]
            for sums in called:
                for k, v in sums.items():
                    out[k] = out.get(k, 0) + v * trips
        memo[comp] = out
        return out

    def parameters(self, comp: str) -> dict[int, str]:
        """``{parameter number: instruction name}`` of ``comp``."""
        out = {}
        for line in self.comps.get(comp, ()):
            m = _INSTRUCTION.match(line)
            if m and m.group(3) == "parameter":
                out[int(re.match(r"(\d+)", m.group(4)).group(1))] = m.group(1)
        return out

    def root(self, comp: str) -> str:
        return next((ln for ln in self.comps.get(comp, ()) if ln.lstrip().startswith("ROOT")), "")

    def users(self, comp: str) -> dict[str, list[tuple]]:
        """``{name: [(op, operand position, result type, user's name, user is the root)]}``
        of the instructions of ``comp`` (read once per computation)."""
        if comp not in self._users:
            out: dict[str, list[tuple]] = {}
            for line in self.comps.get(comp, ()):
                m = _INSTRUCTION.match(line)
                if m:
                    root = line.lstrip().startswith("ROOT")
                    for i, o in enumerate(_operands(m.group(4))):
                        out.setdefault(o, []).append((m.group(3), i, m.group(2), m.group(1), root))
            self._users[comp] = out
        return self._users[comp]

    def line(self, comp: str, name: str) -> str:
        """The line of instruction ``name`` in ``comp`` ("" if none)."""
        if comp not in self._lines:
            self._lines[comp] = {m.group(1): ln for ln in self.comps.get(comp, ())
                                 if (m := _INSTRUCTION.match(ln))}
        return self._lines[comp].get(name, "")

    def callees_of(self, comp: str, name: str) -> list[str]:
        """The computations instruction ``name`` of ``comp`` calls."""
        return self.callees(self.line(comp, name), comp)

    def types(self, comp: str) -> dict[str, str]:
        """``{instruction name: its result type}`` in ``comp``, read once per computation
        (the counts ask for every instruction's operands)."""
        if comp not in self._types:
            self._types[comp] = self._read_types(comp)
        return self._types[comp]

    def _read_types(self, comp: str) -> dict[str, str]:
        out = {}
        for line in self.comps.get(comp, ()):
            m = _INSTRUCTION.match(line)
            if m:
                out[m.group(1)] = m.group(2)
        return out


def _operands(args: str) -> list[str]:
    """The ``%name`` operands of an instruction, from the text after its ``op(``."""
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", args[:end])


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """``{kind: {"count", "bytes"}}`` of the collectives one run of the program executes
    (per device)."""
    def count(line, comp, program):
        m = _INSTRUCTION.match(line)
        kind = m.group(3) if m else ""
        base = kind[:-6] if kind.endswith("-start") else kind
        if base not in COLLECTIVES:
            return {}
        return {(base, 0): 1, (base, 1): result_bytes(m.group(2), kind != base)}

    program = Program(hlo_text)
    if program.entry is None:
        return {}
    sums = program.total(count)
    return {k: {"count": sums[(k, 0)], "bytes": sums[(k, 1)]}
            for k in sorted({k for k, _ in sums})}


def _matmul_flops(line: str, types: dict[str, str]) -> float:
    """FLOPs of a ``dot`` or ``convolution`` line (2 per multiply-add), 0 for any other."""
    m = _INSTRUCTION.match(line)
    if not m or m.group(3) not in ("dot", "convolution"):
        return 0.0
    out = _SHAPE.findall(m.group(2))
    operands = _operands(m.group(4))
    shapes = [_SHAPE.search(types.get(o, "")) for o in operands[:2]]
    if not out or len(shapes) < 2 or None in shapes:
        return 0.0
    out_elems = math.prod(_dims(out[0][1]))
    lhs, rhs = _dims(shapes[0].group(2)), _dims(shapes[1].group(2))
    if m.group(3) == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        k = math.prod(lhs[i] for i in _dims(contracting.group(1))) if contracting else 1
        return 2.0 * out_elems * k
    return _convolution_flops(line, out[0][1], shapes[0].group(2), rhs)


def _convolution_flops(line: str, out: str, lhs: str, rhs: list[int]) -> float:
    """2 x output batch x output features x input features (per group) x the (output
    position, window position) pairs of each spatial dim that fall on the input, not on its
    padding (``dim_labels`` name the dims, ``window`` the sizes, strides and padding)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
    if not labels:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    out_d, lhs_d = _dims(out), _dims(lhs)
    flops = 2.0 * out_d[out_l.index("b")] * out_d[out_l.index("f")] * rhs[rhs_l.index("i")]
    window = re.search(r"window=\{([^}]*)\}", line)
    attrs = dict(kv.split("=", 1) for kv in window.group(1).split()) if window else {}
    spatial = sorted(c for c in out_l if c.isdigit())
    field = lambda name, default: ([int(x) for x in attrs[name].split("x")]  # noqa: E731
                                   if name in attrs else [default] * len(spatial))
    sizes, strides = field("size", 1), field("stride", 1)
    dilate, rdilate = field("lhs_dilate", 1), field("rhs_dilate", 1)
    pads = ([tuple(int(v) for v in p.split("_")) for p in attrs["pad"].split("x")]
            if "pad" in attrs else [(0, 0)] * len(spatial))
    for i, c in enumerate(spatial):
        size_in, size_out = lhs_d[lhs_l.index(c)], out_d[out_l.index(c)]
        flops *= _window_pairs(size_in, size_out, sizes[i], strides[i], pads[i][0],
                               dilate[i], rdilate[i])
    return flops


def _window_pairs(size_in: int, size_out: int, window: int, stride: int, pad: int,
                  dilate: int, rdilate: int) -> int:
    """(output position o, window position w) pairs whose input position
    ``o stride + w rdilate - pad`` is a real element of the (``dilate``-dilated) input."""
    last = (size_in - 1) * dilate
    pairs = 0
    for w in range(window):
        start = w * rdilate - pad                 # the input position of o = 0
        if dilate == 1:                           # o in [ceil(-start / s), floor((last - start) / s)]
            lo, hi = max(0, -(start // stride)), min(size_out - 1, (last - start) // stride)
            pairs += max(0, hi - lo + 1)
        else:
            pairs += sum(1 for o in range(size_out) for q in [o * stride + start]
                         if 0 <= q <= last and q % dilate == 0)
    return pairs


def _mosaic_flops(line: str, types: dict[str, str]) -> float:
    name = re.match(r"^\s*(?:ROOT\s+)?%?([\w\-]+?)(?:\.\d+)*\s*=", line)
    name = name.group(1) if name else ""
    splash = re.match(r"splash_m[hq]a_(fwd|dkv|dq)", name)
    matmuls = MOSAIC_MATMULS.get(f"splash_{splash.group(1)}" if splash else name, 0)
    operands = _operands(line.split("custom-call(", 1)[1])
    shapes = [_SHAPE.search(types.get(o, "")) for o in operands]
    if name in NF4_MATMULS:
        codes = [_dims(s.group(2)) for s in shapes if s is not None and s.group(1) == "u8"]
        rows = _dims(shapes[0].group(2))[0] if shapes and shapes[0] is not None else 0
        return 4.0 * rows * math.prod(codes[0]) if codes else 0.0
    if splash:       # Q and K: the first two floating-point operands (after the tables)
        shapes = [m for m in shapes if m is not None and m.group(1)[0] in "bf"]
    shapes = shapes[:2]
    if not matmuls or len(shapes) < 2 or None in shapes:
        return 0.0
    q, k = _dims(shapes[0].group(2)), _dims(shapes[1].group(2))
    return 2.0 * matmuls * math.prod(q) * k[-2]


def _fusion_bytes(program: Program, fused: str, operand_types: list[str], result: str) -> int:
    """HBM bytes of one fusion: its operands (:func:`_reads`: only the slice of one that is
    dynamic-sliced, nothing of the buffer a dynamic-update-slice root writes into) and its
    outputs (only the update of a dynamic-update-slice root)."""
    params = program.parameters(fused)
    total = 0
    for i, t in enumerate(operand_types):
        full = _hbm_bytes(t)
        total += min(full, _reads(program, fused, params.get(i, ""), full, top=True)) if full else 0
    root = program.root(fused)
    m = _INSTRUCTION.match(root)
    if m and m.group(3) == "dynamic-update-slice":
        update = _operands(m.group(4))[1:2]
        types = program.types(fused)
        return total + sum(_hbm_bytes(types.get(u, "")) for u in update) * bool(_hbm_bytes(result))
    return total + _hbm_bytes(result)


# ops through which a fusion operand reaches a dynamic slice unchanged in size
_THROUGH = ("bitcast", "copy")


def _reads(program: Program, comp: str, name: str, full: float, top: bool = False) -> float:
    """Bytes that computation ``comp`` reads of its value ``name`` (``full`` bytes in all):
    a dynamic slice of it (operand 0) reads its slice, the buffer operand of a root
    dynamic-update-slice of the fusion (``top``) nothing (it is updated in place); through
    bitcasts, copies (a change of tiling) and the parameters of nested fusions; any
    other use reads all of it."""
    uses = program.users(comp).get(name, [])
    if not uses:
        return full
    total = 0.0
    for op, pos, result, user, root in uses:
        if op == "dynamic-slice" and pos == 0:
            total += result_bytes(result)
        elif op == "dynamic-update-slice" and pos == 0 and root and top:
            continue
        elif op in _THROUGH:
            total += _reads(program, comp, user, full)
        elif op == "fusion" and len(program.callees_of(comp, user)) == 1:
            callee = program.callees_of(comp, user)[0]
            param = program.parameters(callee).get(pos, "")
            if _copy_of(program, callee, param):      # a nested copy: its users read it
                total += _reads(program, comp, user, full)
            else:
                total += _reads(program, callee, param, full)
        else:
            return full
    return min(total, full)


def _copy_of(program: Program, comp: str, name: str) -> bool:
    """Whether the root of ``comp`` is its value ``name`` through bitcasts and copies alone."""
    line = program.root(comp)
    while (m := _INSTRUCTION.match(line)) and m.group(1) != name:
        operands = _operands(m.group(4))
        if m.group(3) not in _THROUGH or len(operands) != 1:
            return False
        line = program.line(comp, operands[0])
    return m is not None


def _copy_bytes(op: str, result: str, operand_types: list[str]) -> int:
    """A slice reads its slice (where its operand is in HBM) and writes it (where its
    result is); an async slice's or copy's tuple holds its operand(s) and context beside
    the result (``slice-start``: ``((operand), result, context)``; ``copy-start``:
    ``(result, operand, context)``), which count once, as the operand read."""
    arrays = _ARRAY.findall(result)
    out = arrays[len(operand_types)] if op == "slice-start" else arrays[0]
    size = int(math.prod(_dims(out[1])) * _BYTES[out[0]])
    written = size if "S(1)" not in (out[2] or "") else 0
    if op == "copy-start":
        return sum(map(_hbm_bytes, operand_types)) + written
    return (size if not operand_types or _hbm_bytes(operand_types[0]) else 0) + written


def _inside_fusions(program: Program) -> set[str]:
    """Computations that run inside an instruction (fusions, reductions' ``to_apply``):
    their FLOPs count, their data stays on chip."""
    todo = [c for lines in program.comps.values() for ln in lines
            if re.search(r"\sfusion\(|to_apply=", ln) for c in program.callees(ln, "")]
    seen: set[str] = set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo += [d for ln in program.comps.get(c, ()) for d in program.callees(ln, c)]
    return seen


def costs(hlo_text: str) -> dict[str, float]:
    """``{"flops", "bytes"}`` of one run of a compiled program (per device, the shard each
    device runs): see the module docstring."""
    program = Program(hlo_text)
    fused = _inside_fusions(program)

    def count(line, comp, program):
        types = program.types(comp)
        flops = _matmul_flops(line, types)
        if "tpu_custom_call" in line:
            flops += _mosaic_flops(line, types)
        if comp in fused:                     # inside a fusion: its FLOPs, no HBM traffic
            return {"flops": flops}
        m = _INSTRUCTION.match(line)
        if not m or m.group(3) in FREE or m.group(3).endswith("-done"):
            return {"flops": flops}
        op, result = m.group(3), m.group(2)
        operand_types = [types.get(o, "") for o in _operands(m.group(4))]
        if op == "fusion":
            callee = program.callees(line, comp)
            nbytes = _fusion_bytes(program, callee[0], operand_types, result) if callee else 0
        elif op in ("dynamic-slice", "slice", "slice-start", "copy-start"):
            nbytes = _copy_bytes(op, result, operand_types)
        elif op == "dynamic-update-slice":
            nbytes = 2 * _hbm_bytes(operand_types[1]) if len(operand_types) > 1 else 0
        else:
            nbytes = sum(map(_hbm_bytes, operand_types)) + _hbm_bytes(result)
        return {"flops": flops, "bytes": nbytes}

    if program.entry is None:
        return {"flops": 0.0, "bytes": 0.0}
    sums = program.total(count)
    return {"flops": float(sums.get("flops", 0.0)), "bytes": float(sums.get("bytes", 0.0))}
