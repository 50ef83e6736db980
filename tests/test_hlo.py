"""Reading a compiled program's FLOPs and HBM bytes from its HLO text (``hlo.costs``),
on a hand-written module whose counts are worked out below."""
import itertools

from transformer_jax import hlo

# A scan of 12 steps whose body reads one [16,32] slice of a stacked [12,16,32] weight
# (a dynamic slice fused into the dot), multiplies an [8,16] activation by it, and writes
# its [8,32] result into row i of a [12,8,32] stack (a dynamic-update-slice); a value the
# compiler keeps in VMEM (S(1)) moves no HBM bytes; a Mosaic flash-attention forward with
# Q and K of (2, 4, 64, 32); a convolution whose window falls partly on padding.
MODULE = """HloModule m

%cond (p: (s32[], f32[8,16], f32[12,16,32], f32[12,8,32])) -> pred[] {
  %p = (s32[], f32[8,16], f32[12,16,32], f32[12,8,32]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(12)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%slice_dot (param_0: f32[12,16,32], param_1: s32[], param_2: f32[8,16]) -> f32[8,32] {
  %param_0 = f32[12,16,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %param_2 = f32[8,16]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %ds = f32[1,16,32]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,16,32}
  %w = f32[16,32]{1,0} bitcast(%ds)
  ROOT %d = f32[8,32]{1,0} dot(%param_2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[8,16], f32[12,16,32], f32[12,8,32])) -> (s32[], f32[8,16], f32[12,16,32], f32[12,8,32]) {
  %p = (s32[], f32[8,16], f32[12,16,32], f32[12,8,32]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %ws = f32[12,16,32]{2,1,0} get-tuple-element(%p), index=2
  %ys = f32[12,8,32]{2,1,0} get-tuple-element(%p), index=3
  %y = f32[8,32]{1,0} fusion(%ws, %i, %x), kind=kOutput, calls=%slice_dot
  %y2 = f32[1,8,32]{2,1,0} bitcast(%y)
  %zero = s32[] constant(0)
  %out = f32[12,8,32]{2,1,0} dynamic-update-slice(%ys, %y2, %i, %zero, %zero)
  %v = f32[8,16]{1,0:T(8,128)S(1)} negate(%x)
  ROOT %t = (s32[], f32[8,16], f32[12,16,32], f32[12,8,32]) tuple(%i, %v, %ws, %out)
}

ENTRY %main (x: f32[8,16], ws: f32[12,16,32], ys: f32[12,8,32], q: bf16[2,4,64,32], k: bf16[2,4,64,32], a: f32[1,128,1], b: f32[4,32,128]) -> f32[12,8,32] {
  %x = f32[8,16]{1,0} parameter(0)
  %ws = f32[12,16,32]{2,1,0} parameter(1)
  %ys = f32[12,8,32]{2,1,0} parameter(2)
  %q = bf16[2,4,64,32]{3,2,1,0} parameter(3)
  %k = bf16[2,4,64,32]{3,2,1,0} parameter(4)
  %a = f32[1,128,1]{2,1,0} parameter(5)
  %b = f32[4,32,128]{2,1,0} parameter(6)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16], f32[12,16,32], f32[12,8,32]) tuple(%zero, %x, %ws, %ys)
  %w = (s32[], f32[8,16], f32[12,16,32], f32[12,8,32]) while(%init), condition=%cond, body=%body
  %flash_attention_fwd.3 = (bf16[2,4,64,32]{3,2,1,0}, f32[2,4,64,1]{3,2,1,0}) custom-call(%q, %k, %k), custom_call_target="tpu_custom_call"
  %conv = f32[128,4,32]{2,1,0} convolution(%a, %b), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=fb0_0oi->b0f
  ROOT %r = f32[12,8,32]{2,1,0} get-tuple-element(%w), index=3
}
"""


def test_costs_count_loop_bodies_times_their_trip_count():
    """FLOPs: 12 dots of 2 x 8 x 32 x 16, the kernel's 2 matmuls of 2 x (2 x 4) x 64 x 64
    x 32, and the convolution's 2 x 128 x 32 x 128 x 4 pairs (o, w) with o + w = 3 on an
    input of one position padded by 3 each side (XLA's cost_analysis would count the
    loop's dot once). Bytes: per step the slice read (16 x 32 x 4), the index and the
    activation read and the result written (4 + 8 x 16 x 4 + 8 x 32 x 4), the update read
    and written (2 x 8 x 32 x 4), the negate's input (8 x 16 x 4; its result stays in
    VMEM); then the kernel's Q, K, K and outputs, and the convolution's operands and
    result."""
    cost = hlo.costs(MODULE)
    assert cost["flops"] == (12 * 2 * 8 * 32 * 16 + 2 * 2 * (2 * 4) * 64 * 64 * 32
                             + 2 * 128 * 32 * 128 * 4)
    step = 16 * 32 * 4 + 4 + 8 * 16 * 4 + 8 * 32 * 4 + 2 * 8 * 32 * 4 + 8 * 16 * 4
    kernel = 3 * 2 * 4 * 64 * 32 * 2 + 2 * 4 * 64 * 32 * 2 + 2 * 4 * 64 * 4
    conv = 128 * 4 + 4 * 32 * 128 * 4 + 128 * 4 * 32 * 4
    assert cost["bytes"] == 12 * step + kernel + conv


def test_window_pairs_are_the_positions_that_fall_on_the_input():
    """The closed form (and the dilated input's count) against counting every pair."""
    def every_pair(size_in, size_out, window, stride, pad, dilate, rdilate):
        return sum(1 for o in range(size_out) for w in range(window)
                   for q in [o * stride + w * rdilate - pad]
                   if 0 <= q <= (size_in - 1) * dilate and q % dilate == 0)
    for case in itertools.product([1, 3, 7], [1, 4, 5], [1, 3, 4], [1, 2], [0, 1, 3], [1, 2],
                                  [1, 2]):
        assert hlo._window_pairs(*case) == every_pair(*case), case
    assert hlo._window_pairs(1, 4, 4, 1, 3, 1, 1) == 4     # the module's convolution


def test_a_conditional_counts_its_largest_branch():
    """One branch runs: branch b's two dots (2 x 4 x 4 x 8 + 2 x 4 x 4 x 4 FLOPs; reads of
    [4,8] twice and [4,4] twice, two [4,4] writes), not a's one dot added to them."""
    module = """HloModule m

%a (p: f32[4,8]) -> f32[4,4] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%b (p: f32[4,8]) -> f32[4,4] {
  %p = f32[4,8]{1,0} parameter(0)
  %d = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %e = f32[4,4]{1,0} dot(%d, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[4,8], i: s32[]) -> f32[4,4] {
  %x = f32[4,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %c = f32[4,4]{1,0} conditional(%i, %x, %x), branch_computations={%a, %b}
}
"""
    assert hlo.costs(module) == {"flops": 2 * 4 * 4 * 8 + 2 * 4 * 4 * 4,
                                 "bytes": 2 * 4 * 8 * 4 + 2 * 4 * 4 * 4 + 2 * 4 * 4 * 4}


def test_splash_kernels_count_their_q_and_k_after_the_mask_tables():
    """A splash dQ kernel (3 matmuls of 2 x (2 x 4) x 64 x 128 x 32 FLOPs): its Q (B, N, T, H)
    and K (B, K, S, H) come after the s8 scalar-prefetch tables, and its kv heads (2)
    serve 4 query heads."""
    module = """HloModule m

ENTRY %main (t: s8[1,1,1], q: bf16[2,4,64,32], k: bf16[2,2,128,32]) -> f32[2,4,64,32] {
  %t = s8[1,1,1]{2,1,0} parameter(0)
  %q = bf16[2,4,64,32]{3,2,1,0} parameter(1)
  %k = bf16[2,2,128,32]{3,2,1,0} parameter(2)
  ROOT %splash_mha_dq_no_residuals.1 = f32[2,4,64,32]{3,2,1,0} custom-call(%t, %t, %q, %k, %k), custom_call_target="tpu_custom_call"
}
"""
    assert hlo.costs(module)["flops"] == 3 * 2 * (2 * 4 * 64 * 32) * 128


def test_costs_read_each_computations_types_once(monkeypatch):
    """Linear in the program: the result types of each computation whose instructions
    count are read once, not once per instruction (that made a tiny GPT's TPU program
    take 5 s instead of 0.2 s). Here: the entry, the loop body and the fusion; the loop
    condition counts nothing."""
    calls = []
    real = hlo.Program._read_types

    def types(self, comp):
        calls.append(comp)
        return real(self, comp)

    monkeypatch.setattr(hlo.Program, "_read_types", types)
    hlo.costs(MODULE)
    assert sorted(calls) == ["body", "main", "slice_dot"]


def test_slices_copies_and_in_place_updates_count_what_moves():
    """A fusion that dynamic-slices one [16,32] layer of a stacked [12,16,32] weight after
    retiling it (a nested copy fusion: what XLA:TPU does for a scanned stack) reads the
    slice (16 x 32 x 4) and the index, and writes its [16,32]; a fusion whose root updates
    a [12,8,32] buffer in place reads the update and the index and writes the update, not
    the buffer; an async slice into VMEM reads its [16,128] slice, an async copy into VMEM
    its [64,128] operand, once (their tuples hold the operand too), and write nothing to
    HBM."""
    module = """HloModule m

%copy_fusion (input: f32[12,16,32]) -> f32[12,16,32] {
  %input = f32[12,16,32]{2,1,0:T(8,128)} parameter(0)
  ROOT %c = f32[12,16,32]{2,1,0:T(2,128)} copy(%input)
}

%slice_through_copy (param_0: f32[12,16,32], param_1: s32[]) -> f32[16,32] {
  %param_0 = f32[12,16,32]{2,1,0:T(8,128)} parameter(0)
  %param_1 = s32[] parameter(1)
  %retiled = f32[12,16,32]{2,1,0:T(2,128)} fusion(%param_0), kind=kLoop, calls=%copy_fusion
  %zero = s32[] constant(0)
  %ds = f32[1,16,32]{2,1,0} dynamic-slice(%retiled, %param_1, %zero, %zero), dynamic_slice_sizes={1,16,32}
  %b = f32[16,32]{1,0} bitcast(%ds)
  ROOT %out = f32[16,32]{1,0:T(8,128)} copy(%b)
}

%update (param_0: f32[12,8,32], param_1: f32[1,8,32], param_2: s32[]) -> f32[12,8,32] {
  %param_0 = f32[12,8,32]{2,1,0} parameter(0)
  %param_1 = f32[1,8,32]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[12,8,32]{2,1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %zero, %zero)
}

ENTRY %main (ws: f32[12,16,32], i: s32[], ys: f32[12,8,32], y: f32[1,8,32], a: f32[64,128]) -> f32[16,32] {
  %ws = f32[12,16,32]{2,1,0:T(8,128)} parameter(0)
  %i = s32[] parameter(1)
  %ys = f32[12,8,32]{2,1,0} parameter(2)
  %y = f32[1,8,32]{2,1,0} parameter(3)
  %a = f32[64,128]{1,0} parameter(4)
  %w = f32[16,32]{1,0:T(8,128)} fusion(%ws, %i), kind=kLoop, calls=%slice_through_copy
  %ys2 = f32[12,8,32]{2,1,0} fusion(%ys, %y, %i), kind=kLoop, calls=%update
  %s = ((f32[64,128]{1,0}), f32[16,128]{1,0:S(1)}, s32[]) slice-start(%a), slice={[0:16], [0:128]}
  %sd = f32[16,128]{1,0:S(1)} slice-done(%s)
  %c = (f32[64,128]{1,0:S(1)}, f32[64,128]{1,0}, u32[]) copy-start(%a)
  %cd = f32[64,128]{1,0:S(1)} copy-done(%c)
  ROOT %t = (f32[16,32], f32[12,8,32], f32[16,128], f32[64,128]) tuple(%w, %ys2, %sd, %cd)
}
"""
    layer = 16 * 32 * 4 + 4 + 16 * 32 * 4
    update = 8 * 32 * 4 + 4 + 8 * 32 * 4
    assert hlo.costs(module) == {"flops": 0.0,
                                 "bytes": layer + update + 16 * 128 * 4 + 64 * 128 * 4}
