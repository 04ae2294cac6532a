"""flash_attn_varlen_func on a CPU-only machine: every argument error (named,
raised before the device check), the custom ops' fake implementations, and
a float64 emulation of the varlen kernels' index math (tile maps,
per-sequence offsets, the backward's padded fp32 rows, masks, the zeroed
tails), run against the per-sequence reference with NaN in every row outside
a sequence's live part.

The emulation follows the kernels' rules as their docstrings state them
(kernels/forward.py VARLEN mode, kernels/backward.py ``bwd_sequence``,
backward_pre.py); the expectation is the textbook reference, never the code
under test.
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks, ops
from hopper_flash.plan_backward import varlen_padded_rows
from hopper_flash.reference import attention_reference_grads, varlen_grads, varlen_reference
from launch_fakes import FakeDriver, FakeJIT

BF16 = torch.bfloat16
DEVICE_ERROR = r"q must be a CUDA tensor on a Hopper GPU \(sm_90\), got device 'cpu'"


def cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def problem(lq=(5, 9), lk=(7, 3), h=4, hkv=2, d=64, dtype=BF16):
    q = torch.randn(sum(lq), h, d).to(dtype)
    k = torch.randn(sum(lk), hkv, d).to(dtype)
    v = torch.randn(sum(lk), hkv, d).to(dtype)
    return q, k, v, cu(lq), cu(lk)


def call(q, k, v, cq, ck, mq=16, mk=16, **kw):
    return hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, **kw)


# ---------------------------------------------------------------- argument errors

def test_well_formed_call_reaches_the_device_check():
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(*problem())


def test_exported():
    assert "flash_attn_varlen_func" in hopper_flash.__all__


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_rank(name):
    args = dict(zip("qkv", problem()[:3]))
    args[name] = args[name][None]
    with pytest.raises(ValueError, match=rf"^{name} must have 3 dimensions \[total_tokens, nheads, headdim\]"):
        call(args["q"], args["k"], args["v"], *problem()[3:])


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("bad,match", [
    (lambda c: c.long(), "must have dtype int32"),
    (lambda c: c.float(), "must have dtype int32"),
    (lambda c: c[None], "1-D"),
    (lambda c: c[:2], "entries"),
    (lambda c: [0, 5, 14], "must be a torch.Tensor"),
    (lambda c: c.to("meta"), "must be on q's device"),
], ids=["int64", "float", "2d", "length", "list", "device"])
def test_cu_seqlens_errors_name_the_argument(name, bad, match):
    q, k, v, cq, ck = problem()
    args = {"cu_seqlens_q": cq, "cu_seqlens_k": ck}
    if name == "cu_seqlens_q" and match == "entries":
        # cu_seqlens_q fixes the batch: a shorter one makes cu_seqlens_k the wrong length
        args[name] = bad(args[name])
        with pytest.raises(ValueError, match="^cu_seqlens_k must have 2 entries"):
            call(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], mq=100, mk=100)
        return
    args[name] = bad(args[name])
    err = TypeError if match.startswith("must be a torch") else ValueError
    with pytest.raises(err, match=rf"^{name} {match}|^{name} must"):
        call(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"])


def test_cu_seqlens_q_needs_two_entries():
    q, k, v, cq, ck = problem()
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must be 1-D with batch \+ 1 >= 2 entries"):
        call(q, k, v, cq[:1], ck)


@pytest.mark.parametrize("name", ["seqused_q", "seqused_k"])
@pytest.mark.parametrize("bad,match", [
    (lambda: torch.tensor([1, 2]), "must have dtype int32"),
    (lambda: torch.tensor([1, 2, 3], dtype=torch.int32), "must have 2 entries"),
    (lambda: torch.tensor([[1, 2]], dtype=torch.int32), "must be 1-D"),
], ids=["int64", "length", "2d"])
def test_seqused_errors_name_the_argument(name, bad, match):
    with pytest.raises(ValueError, match=rf"^{name} {match}"):
        call(*problem(), **{name: bad()})


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("bad,err", [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError),
                                     (None, TypeError), (torch.tensor(9), TypeError)],
                         ids=["zero", "negative", "float", "bool", "None", "tensor"])
def test_max_seqlen_must_be_a_positive_int(name, bad, err):
    q, k, v, cq, ck = problem()
    kw = {"mq": 16, "mk": 16}
    kw["mq" if name.endswith("q") else "mk"] = bad
    with pytest.raises(err, match=rf"^{name} must be a positive int"):
        call(q, k, v, cq, ck, **kw)


def test_numpy_like_ints_are_accepted_as_bounds():
    q, k, v, cq, ck = problem()
    import numbers

    class MyInt(int):
        pass

    assert isinstance(MyInt(3), numbers.Integral)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(q, k, v, cq, ck, mq=MyInt(16), mk=MyInt(16))


@pytest.mark.parametrize("side", ["q", "k"])
def test_totals_beyond_batch_times_max_seqlen(side):
    q, k, v, cq, ck = problem(lq=(5, 9), lk=(7, 3))
    kw = dict(mq=16, mk=16)
    if side == "q":
        kw["mq"] = 6  # 14 tokens > 2 x 6
    else:
        kw["mk"] = 4  # 10 tokens > 2 x 4
    with pytest.raises(ValueError, match=rf"^{side} has \d+ tokens, more than batch \(2\) x max_seqlen_{side}"):
        call(q, k, v, cq, ck, **kw)


def test_totals_check_is_skipped_with_seqused():
    """With seqused the slots may be longer than max_seqlen (only the live part is bounded)."""
    q, k, v, cq, ck = problem(lq=(5, 9), lk=(7, 3))
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(q, k, v, cq, ck, mq=6, mk=16, seqused_q=torch.tensor([5, 6], dtype=torch.int32))


def test_tensor_checks_shared_with_the_fixed_length_path():
    q, k, v, cq, ck = problem()
    with pytest.raises(ValueError, match=r"^q, k and v must have the same dtype"):
        call(q, k.half(), v.half(), cq, ck)
    with pytest.raises(ValueError, match=r"^q.dtype must be one of \(bfloat16, float16\), got float32"):
        call(q.float(), k.float(), v.float(), cq, ck)
    with pytest.raises(ValueError, match=r"^head dim \(q.shape\[2\]\) must be one of \(64, 128, 256\) or a "
                                         r"multiple of 8 below 256 \(run on the next of those\), got 36$"):
        call(q[..., :36], k[..., :36], v[..., :36], cq, ck)  # 36: not a multiple of 8 (32 runs on 64)
    with pytest.raises(ValueError, match=r"^q's number of heads \(4\) must be a multiple of k/v's number of heads"):
        call(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cq, ck)
    with pytest.raises(ValueError, match=r"^k and v must have the same shape"):
        call(q, k, v[:-1], cq, ck)
    with pytest.raises(TypeError, match=r"^causal must be a bool"):
        call(q, k, v, cq, ck, causal=1)
    with pytest.raises(ValueError, match=r"^softmax_scale must be a finite positive number"):
        call(q, k, v, cq, ck, softmax_scale=-1.0)


@pytest.mark.parametrize("kw", [dict(dropout_p=0.1), dict(return_attn_probs=True)])
def test_flash_attn_options_refused_by_name(kw):
    # (block_table is served: test_paged_varlen_cpu.py)
    with pytest.raises(NotImplementedError, match=list(kw)[0]):
        call(*problem(), **kw)


def test_a_window_is_checked_then_reaches_the_device_check():
    with pytest.raises(ValueError, match="window_size entries must be >= 0"):
        call(*problem(), window_size=(-3, 0))
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(*problem(), causal=True, window_size=(4, 0))
    q, k, v, cq, ck = problem()
    q.requires_grad_()
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(q, k, v, cq, ck, causal=True, window_size=(4, 0))


def test_a_softcap_is_checked_then_reaches_the_device_check():
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        call(*problem(), softcap=-2.0)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(*problem(), causal=True, softcap=30.0)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_num_splits_is_checked_by_name_on_every_path(bad):
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        call(*problem(), num_splits=bad)
    q, k, v, cq, ck = problem()
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        call(q.requires_grad_(), k, v, cq, ck, num_splits=bad)
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        call(*problem(), num_splits=bad, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):  # the op's fake (torch.compile)
        ops._varlen_fwd_fake(meta(q), meta(k), meta(v), meta(cq), meta(ck), None, None, 16, 16, 0.1, True,
                             num_splits=-1)
    with pytest.raises(ValueError, match=DEVICE_ERROR):  # a good count passes on to the device check
        call(*problem(), num_splits=4)


def test_flash_attn_no_op_options_accepted():
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(*problem(), dropout_p=0.0, window_size=(-1, -1), softcap=0.0, deterministic=True)


def test_keyword_only_after_max_seqlen():
    q, k, v, cq, ck = problem()
    with pytest.raises(TypeError):
        hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 16, 16, None)


def test_requires_grad_goes_through_the_op_and_checks_first():
    q, k, v, cq, ck = problem()
    q.requires_grad_()
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must have dtype int32"):
        call(q, k, v, cq.long(), ck)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        call(q, k, v, cq, ck)


# ---------------------------------------------------------------- remembered signatures

@pytest.fixture
def remembered(signature_memory, monkeypatch):
    """checks.validate_varlen's memory of passed signatures, fresh, for CPU
    tensors (the device check stubbed); the number of times the checks ran."""
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    return signature_memory("check_varlen_arguments")


def validate(q, k, v, cq, ck, mq=16, mk=16, used_q=None, used_k=None, scale=None, causal=True):
    return checks.validate_varlen(q, k, v, cq, ck, mq, mk, used_q, used_k, scale, causal)


def test_validate_varlen_remembers_a_passed_signature(remembered):
    # Every layer of a continuous-batching step: new tensors, one signature.
    assert validate(*problem()) == (pytest.approx(1 / 8), 16, 16)
    assert validate(*problem()) == (pytest.approx(1 / 8), 16, 16)
    assert len(remembered) == 1
    validate(*problem(), mq=17)  # another bound, another signature
    validate(*problem(), used_q=torch.tensor([5, 9], dtype=torch.int32))
    assert len(remembered) == 3


@pytest.mark.parametrize("change, error, match", [
    (dict(causal=1), TypeError, r"^causal must be a bool"),  # 1 == True as a dict key
    (dict(mq=True), TypeError, r"^max_seqlen_q must be a positive int"),  # True == 1
    (dict(mq=6), ValueError, r"^q has 14 tokens, more than batch \(2\) x max_seqlen_q \(6\)"),
    (dict(ck="int64"), ValueError, r"^cu_seqlens_k must have dtype int32"),
    (dict(used_k="short"), ValueError, r"^seqused_k must have 2 entries"),
    (dict(v="misaligned"), ValueError, r"^v's data pointer must be 16-byte aligned"),
    (dict(q="strided"), ValueError, r"^q must be contiguous in its last \(headdim\) dimension"),
    (dict(k="fp16"), ValueError, r"^q, k and v must have the same dtype"),
])
def test_a_remembered_varlen_signature_still_refuses_what_differs(remembered, change, error, match):
    q, k, v, cq, ck = problem()
    args = dict(q=q, k=k, v=v, cq=cq, ck=ck, mq=7, mk=16, used_q=None, used_k=torch.tensor([7, 3], dtype=torch.int32),
                causal=True)
    validate(**args)
    for name, how in change.items():
        if how == "fp16":
            args[name] = args[name].to(torch.float16)
        elif how == "int64":
            args[name] = args[name].long()
        elif how == "short":
            args[name] = args[name][:1]
        elif how == "misaligned":
            buf = torch.randn(args[name].numel() + 1).to(BF16)
            args[name] = buf[1:].view(args[name].shape)  # 2 bytes past a 16-byte boundary
        elif how == "strided":
            args[name] = torch.randn(q.shape[0], q.shape[2], q.shape[1]).to(BF16).transpose(1, 2)
        else:
            args[name] = how
    with pytest.raises(error, match=match):
        validate(**args)


def test_validate_varlen_remembers_no_cpu_tensors(monkeypatch):
    # The shipped memory is for CUDA tensors only (the device check stubbed
    # here must not leave a CPU signature passing for later calls).
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(checks, "_PASSED", {})
    validate(*problem())
    assert checks._PASSED == {}


def test_an_unreadable_signature_is_left_to_the_checks(remembered):
    q, k, v, cq, ck = problem()
    with pytest.raises(TypeError, match=r"^cu_seqlens_k must be a torch.Tensor"):
        validate(q, k, v, cq, [0, 7, 10])
    with pytest.raises(TypeError, match=r"^softmax_scale"):
        validate(q, k, v, cq, ck, scale=[0.5])  # unhashable
    assert checks._PASSED == {}


# ---------------------------------------------------------------- the opt-in contract check

def contract(q, k, cq, ck, mq=16, mk=16, uq=None, uk=None):
    checks.check_varlen_contract(q, k, cq, ck, mq, mk, uq, uk)


def test_contract_check_passes_a_good_batch():
    q, k, v, cq, ck = problem()
    contract(q, k, cq, ck)
    contract(q, k, cq, ck, uq=torch.tensor([5, 0], dtype=torch.int32), uk=torch.tensor([7, 3], dtype=torch.int32))


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(cq=torch.tensor([1, 5, 14], dtype=torch.int32)), r"cu_seqlens_q\[0\] must be 0"),
    (lambda a: a.update(ck=torch.tensor([0, 7, 5], dtype=torch.int32)), "cu_seqlens_k must be non-decreasing"),
    (lambda a: a.update(cq=torch.tensor([0, 5, 15], dtype=torch.int32)), r"cu_seqlens_q\[-1\] \(15\) exceeds"),
    (lambda a: a.update(mq=8), r"max_seqlen_q \(8\) is below the longest sequence \(9\)"),
    (lambda a: a.update(uk=torch.tensor([8, 3], dtype=torch.int32)), "seqused_k must lie in"),
])
def test_contract_check_names_the_violation(mutate, match):
    q, k, v, cq, ck = problem()
    a = dict(cq=cq, ck=ck)
    mutate(a)
    with pytest.raises(ValueError, match=match):
        contract(q, k, **a)


def test_contract_check_opt_in_by_env(monkeypatch):
    from hopper_flash import dispatch

    assert dispatch._check_contract_requested(None) is False
    monkeypatch.setenv("HOPPER_FLASH_CHECK_VARLEN", "1")
    assert dispatch._check_contract_requested(None) is True
    assert dispatch._check_contract_requested(False) is False
    # Never inside a CUDA graph capture (a host sync is not allowed there), asked for or not.
    monkeypatch.setattr(checks, "capturing", lambda: True)
    assert dispatch._check_contract_requested(None) is False
    assert dispatch._check_contract_requested(True) is False


# ---------------------------------------------------------------- custom ops (fake)

def meta(t):
    return t.to("meta")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fake_shapes_and_lse_layout(d):
    q, k, v, cq, ck = problem(d=d)
    out, lse = ops._varlen_fwd_fake(meta(q), meta(k), meta(v), meta(cq), meta(ck), None, None, 16, 16, 0.1, True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32


def test_fake_refuses_bad_arguments():
    q, k, v, cq, ck = problem()
    with pytest.raises(ValueError, match="cu_seqlens_k must have dtype int32"):
        ops._varlen_fwd_fake(meta(q), meta(k), meta(v), meta(cq), meta(ck.long()), None, None, 16, 16, 0.1, True)


def test_backward_fake_shapes():
    q, k, v, cq, ck = problem()
    args = (meta(q), meta(q), meta(k), meta(v), meta(q), torch.empty(4, 14, device="meta"), meta(cq), meta(ck), None,
            None, 16, 16, 0.1, True, False)
    dq, dk, dv, dsink = ops._varlen_bwd_fake(*args)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dsink.shape == (0,)
    # With sinks, their gradient in their own shape and dtype.
    dsink = ops._varlen_bwd_fake(*args, -1, -1, 0.0, torch.empty(4, dtype=torch.bfloat16, device="meta"))[3]
    assert dsink.shape == (4,) and dsink.dtype == torch.bfloat16


def test_backward_fake_refuses_unsupported_head_dim_or_bad_grad():
    q, k, v, cq, ck = problem()
    with pytest.raises(ValueError, match="grad_out must have the output's shape"):
        ops._varlen_bwd_fake(meta(q[:-1]), meta(q), meta(k), meta(v), meta(q), torch.empty(4, 14, device="meta"),
                             meta(cq), meta(ck), None, None, 16, 16, 0.1, True, False)


def test_ops_schemas():
    schema = str(torch.ops.hopper_flash.varlen_fwd.default._schema)
    assert "Tensor? seqused_q" in schema and "SymInt max_seqlen_q" in schema
    assert "hopper_flash::varlen_bwd" in str(torch.ops.hopper_flash.varlen_bwd.default._schema)


def test_autograd_through_the_op_on_meta():
    """The op's autograd formula calls varlen_bwd with the saved tensors (meta: shapes only)."""
    q, k, v, cq, ck = problem()
    q, k, v = (meta(x).requires_grad_() for x in (q, k, v))
    out, lse = torch.ops.hopper_flash.varlen_fwd(q, k, v, meta(cq), meta(ck), None, None, 16, 16, 0.125, True,
                                                 False)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ---------------------------------------------------------------- index math, emulated in float64

def _rows(t, start, n):
    """TMA view of ``n`` rows of a THD tensor from ``start``: zero past the tensor's end."""
    out = torch.zeros((n,) + t.shape[1:], dtype=t.dtype)
    lo, hi = max(start, 0), min(start + n, t.shape[0])
    if hi > lo:
        out[lo - start:hi - start] = t[lo:hi]
    return out


def _spans(cu_seqlens, seqused):
    c = cu_seqlens.tolist()
    return [(c[b], int(seqused[b]) if seqused is not None else c[b + 1] - c[b]) for b in range(len(c) - 1)]


def emulate_forward(q, k, v, cq, ck, uq, uk, max_q, causal, scale, BM=128, BN=128):
    """The VARLEN forward's tile map and masks, tile by tile (float64).

    Items (bm, h, b) cover cdiv(max_q, BM) tiles per sequence; an item past
    its sequence's rows does nothing. Q and K/V tiles read rows from the
    sequence start on (into the next sequence, or zeros past the tensor).
    KV tiles 0 .. n_hi - 1 with n_hi from the causal bound; keys past the
    sequence are masked (a where, so NaN scores vanish) in the tiles that
    cross the tail, which is only the first one visited, whose V rows past
    the tail are zeroed. O and LSE rows are stored only below lq."""
    total_q, H, D = q.shape
    g = H // k.shape[1]
    out = torch.full(q.shape, math.nan, dtype=torch.float64)
    lse = torch.full((H, total_q), math.nan, dtype=torch.float64)
    for b, ((qs, lq), (ks, lk)) in enumerate(zip(_spans(cq, uq), _spans(ck, uk))):
        for bm in range(-(-max_q // BM)):
            if bm * BM >= lq:
                continue  # item skipped
            if causal:
                last_key = min((bm + 1) * BM + lk - lq, lk)
                n_hi = max(-(-max(last_key, 0) // BN), 1)
            else:
                n_hi = max(-(-lk // BN), 1)
            for h in range(H):
                qt = _rows(q[:, h], qs + bm * BM, BM).double()
                rows = bm * BM + torch.arange(BM)
                s_all, v_all = [], []
                for bn in range(n_hi):
                    kt = _rows(k[:, h // g], ks + bn * BN, BN).double()
                    vt = _rows(v[:, h // g], ks + bn * BN, BN).double()
                    cols = bn * BN + torch.arange(BN)
                    s = qt @ kt.T * scale
                    crosses_tail = (bn + 1) * BN > lk
                    crosses_diag = causal and (bn + 1) * BN - 1 > bm * BM + lk - lq
                    if bn == n_hi - 1 or crosses_tail or crosses_diag:
                        hidden = cols[None, :] >= lk
                        if causal:
                            hidden = hidden | (cols[None, :] > rows[:, None] + lk - lq)
                        s = torch.where(hidden, -math.inf, s)
                    if bn == n_hi - 1:
                        vt = torch.where((cols < lk)[:, None], vt, 0.0)
                    else:
                        assert not crosses_tail, "only the first KV tile visited may cross the tail"
                    s_all.append(s)
                    v_all.append(vt)
                s = torch.cat(s_all, 1)
                m = s.max(1).values
                m_safe = torch.where(m == -math.inf, 0.0, m)
                p = torch.exp(s - m_safe[:, None])
                l = p.sum(1)
                o = (p @ torch.cat(v_all, 0)) / torch.where(l == 0, 1.0, l)[:, None]
                row_lse = torch.where(l == 0, -math.inf, m_safe + torch.log(l))
                keep = rows < lq
                out[qs + rows[keep], h] = o[keep]
                lse[h, qs + rows[keep]] = row_lse[keep]
    return out, lse


def emulate_backward(q, k, v, out, lse, dout, cq, ck, uq, uk, max_q, max_k, causal, scale, BM=64, BN=128):
    """The varlen backward's index math (float64): padded stats rows per
    sequence at round_down(cu_q[b] + b·BM, BM), the preprocess writing only a
    sequence's own tiles, KV-tile CTAs over cdiv(max_k, BN) tiles (idle past
    the sequence), Q/dO/K/V tails zeroed, dQ accumulated into the padded rows,
    dK/dV stored only below lk. Also asserts that no two sequences' tiles
    share a padded row and that every stat row read was written."""
    total_q, H, D = q.shape
    B = cq.numel() - 1
    Hkv = k.shape[1]
    g = H // Hkv
    padded = varlen_padded_rows(total_q, B, BM)
    owner = torch.full((padded,), -1)
    lse2 = torch.full((H, padded), math.nan, dtype=torch.float64)
    delta = torch.full((H, padded), math.nan, dtype=torch.float64)
    dq_acc = torch.zeros(H, padded, D, dtype=torch.float64)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    spans_q, spans_k = _spans(cq, uq), _spans(ck, uk)
    for b, (qs, lq) in enumerate(spans_q):  # preprocess
        stat0 = (qs + b * BM) // BM * BM
        owned = -(-lq // BM) * BM
        assert stat0 + owned <= padded
        assert (owner[stat0:stat0 + owned] == -1).all(), "two sequences share a padded stats row"
        owner[stat0:stat0 + owned] = b
        for r in range(owned):
            for h in range(H):
                if r < lq:
                    x = lse[h, qs + r].item()
                    lse2[h, stat0 + r] = 0.0 if x == -math.inf else x * math.log2(math.e)
                    delta[h, stat0 + r] = (out[qs + r, h].double() * dout[qs + r, h].double()).sum()
                else:
                    lse2[h, stat0 + r] = math.inf
                    delta[h, stat0 + r] = 0.0
    c = scale * math.log2(math.e)
    for b, ((qs, lq), (ks, lk)) in enumerate(zip(spans_q, spans_k)):
        stat0 = (qs + b * BM) // BM * BM
        for n in range(-(-max_k // BN)):
            if n * BN >= lk:
                continue  # idle CTA
            m_hi = -(-lq // BM)
            m_lo = min(max(n * BN - (lk - lq), 0) // BM, m_hi) if causal else 0
            keys = n * BN + torch.arange(BN)
            for hk in range(Hkv):
                kt = _rows(k[:, hk], ks + n * BN, BN).double()
                vt = _rows(v[:, hk], ks + n * BN, BN).double()
                kt[keys >= lk] = 0.0
                vt[keys >= lk] = 0.0
                dk_t = torch.zeros(BN, D, dtype=torch.float64)
                dv_t = torch.zeros(BN, D, dtype=torch.float64)
                for h in range(hk * g, hk * g + g):
                    for m in range(m_lo, m_hi):
                        queries = m * BM + torch.arange(BM)
                        qt = _rows(q[:, h], qs + m * BM, BM).double()
                        dot = _rows(dout[:, h], qs + m * BM, BM).double()
                        qt[queries >= lq] = 0.0
                        dot[queries >= lq] = 0.0
                        l2 = lse2[h, stat0 + m * BM:stat0 + (m + 1) * BM]
                        dl = delta[h, stat0 + m * BM:stat0 + (m + 1) * BM]
                        assert not l2.isnan().any() and not dl.isnan().any(), "read an unwritten stats row"
                        st = kt @ qt.T
                        hidden = keys[:, None] >= lk
                        if causal:
                            hidden = hidden | (keys[:, None] > queries[None, :] + lk - lq)
                        st = torch.where(hidden, -math.inf, st)
                        pt = torch.exp2(st * c - l2[None, :])
                        dpt = vt @ dot.T
                        dst = pt * (dpt - dl[None, :])
                        dv_t += pt @ dot
                        dk_t += dst @ qt
                        dq_acc[h, stat0 + m * BM:stat0 + (m + 1) * BM] += dst.T @ kt
                keep = keys < lk
                dk[ks + keys[keep], hk] = dk_t[keep] * scale
                dv[ks + keys[keep], hk] = dv_t[keep]
    for b, (qs, lq) in enumerate(spans_q):  # postprocess
        stat0 = (qs + b * BM) // BM * BM
        dq[qs:qs + lq] = (dq_acc[:, stat0:stat0 + lq] * scale).transpose(0, 1)
    return dq, dk, dv


def _poisoned_batch(lq, lk, used_q=None, used_k=None, h=4, hkv=2, d=16, seed=0):
    """THD q, k, v (float32) with NaN in every row outside a sequence's live part."""
    torch.manual_seed(seed)
    cq, ck = cu(lq), cu(lk)
    q = torch.randn(sum(lq), h, d)
    k = torch.randn(sum(lk), hkv, d)
    v = torch.randn(sum(lk), hkv, d)
    uq = torch.tensor(used_q, dtype=torch.int32) if used_q is not None else None
    uk = torch.tensor(used_k, dtype=torch.int32) if used_k is not None else None
    for t, c, u in ((q, cq, uq), (k, ck, uk), (v, ck, uk)):
        if u is not None:
            for b in range(len(c) - 1):
                t[c[b] + u[b]:c[b + 1]] = math.nan
    return q, k, v, cq, ck, uq, uk


CASES = {
    "mixed": dict(lq=[130, 1, 0, 257, 64], lk=[130, 1, 5, 257, 64]),
    "q_longer": dict(lq=[200, 129, 3], lk=[70, 128, 0]),
    "k_longer": dict(lq=[10, 65, 1], lk=[300, 129, 200]),
    "seqused": dict(lq=[140, 90, 30], lk=[150, 40, 260], used_q=[100, 0, 30], used_k=[129, 40, 1]),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_forward_tile_map_matches_reference(case, causal):
    q, k, v, cq, ck, uq, uk = _poisoned_batch(**CASES[case])
    lens_q = [l for _, l in _spans(cq, uq)]
    scale = 0.25
    out, lse = emulate_forward(q, k, v, cq, ck, uq, uk, max(lens_q), causal, scale)
    ref, ref_lse = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=causal,
                                    softmax_scale=scale)
    for qs, lq in _spans(cq, uq):
        torch.testing.assert_close(out[qs:qs + lq], ref[qs:qs + lq], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse[:, qs:qs + lq], ref_lse[:, qs:qs + lq], atol=1e-10, rtol=1e-10)
    # rows outside every live part were never written (the kernel leaves them: zeros from the allocation)
    live = torch.zeros(q.shape[0], dtype=torch.bool)
    for qs, lq in _spans(cq, uq):
        live[qs:qs + lq] = True
    assert out[~live].isnan().all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_backward_index_math_matches_reference(case, causal):
    q, k, v, cq, ck, uq, uk = _poisoned_batch(**CASES[case])
    scale = 0.25
    out, lse = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=causal, softmax_scale=scale)
    dout = torch.randn(q.shape, dtype=torch.float64)
    live = torch.zeros(q.shape[0], dtype=torch.bool)
    for qs, lq in _spans(cq, uq):
        live[qs:qs + lq] = True
    dout[~live] = math.nan  # the backward must not read gradients of rows outside the live parts either
    lens_q = [l for _, l in _spans(cq, uq)]
    lens_k = [l for _, l in _spans(ck, uk)]
    dq, dk, dv = emulate_backward(q, k, v, out, lse, dout, cq, ck, uq, uk, max(lens_q), max(lens_k), causal, scale)
    ref = varlen_grads(lambda a, b, c, d: attention_reference_grads(a, b, c, d, causal=causal, softmax_scale=scale),
                       q.double(), k.double(), v.double(), dout, cq, ck, seqused_q=uq, seqused_k=uk)
    for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert not x.isnan().any(), name
        torch.testing.assert_close(x, r, atol=1e-9, rtol=1e-9, msg=name)


def test_padded_rows_never_overlap_for_random_batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        B = int(torch.randint(1, 40, (1,), generator=gen))
        lens = torch.randint(0, 300, (B,), generator=gen)
        lens[torch.rand(B, generator=gen) < 0.2] = 0
        c = cu(lens.tolist()).tolist()
        BM = 64
        padded = varlen_padded_rows(c[-1], B, BM)
        end = 0
        for b in range(B):
            stat0 = (c[b] + b * BM) // BM * BM
            assert stat0 % BM == 0 and stat0 >= end
            end = stat0 + -(-(c[b + 1] - c[b]) // BM) * BM
        assert end <= padded


# ---------------------------------------------------------------- bench --varlen (CPU parts)

def test_bench_varlen_config_and_flops():
    from hopper_flash.bench import varlen as bv

    assert bv.parse_range("512:8192") == (512, 8192)
    with pytest.raises(ValueError, match="LO:HI"):
        bv.parse_range("512")
    with pytest.raises(ValueError, match="0 < LO <= HI"):
        bv.VarlenConfig(lo=10, hi=5)
    cfg = bv.VarlenConfig(lo=512, hi=8192)
    lengths = cfg.lengths()
    assert len(lengths) == 16 and all(512 <= n <= 8192 for n in lengths) and lengths == cfg.lengths()
    # causal: half of 4·H·L²·D per sequence
    assert bv.forward_flops([10, 20], 2, 8, True) == 2 * (100 + 400) * 2 * 8
    assert bv.pass_flops(100, "fwd+bwd") == 350


def test_bench_varlen_rounds_interleave_the_cells(monkeypatch):
    """--rounds with --varlen: every judged cell once per round, the order
    rotated; each median over all its rounds' calls."""
    from hopper_flash.bench import varlen as bv
    from hopper_flash.bench.timing import Timing
    from hopper_flash.reference import varlen_reference

    cfg = bv.VarlenConfig(lo=3, hi=9, batch=3, heads=2, kv_heads=1, headdim=16)

    def backend():
        def exact(q, k, v, cu):
            return lambda: varlen_reference(q, k, v, cu, cu, causal=cfg.causal)[0].to(q.dtype)
        return exact

    fakes = {name: backend() for name in "abc"}
    monkeypatch.setattr(bv, "_backends", lambda cfg, lengths: fakes)
    order = []

    def timer(fn):
        name = next(n for n, f in fakes.items() if f is current[fn])
        order.append(name)
        ms = {"a": [1.0, 3.0, 2.0], "b": [4.0, 4.0, 4.0], "c": [9.0, 1.0, 1.0]}[name][order.count(name) - 1]
        return Timing(ms, ms, ms, 2, (ms, ms))

    current = {}
    real_pass_fn = bv._pass_fn

    def pass_fn(which, factory, q, k, v, cu):
        fn = real_pass_fn(which, factory, q, k, v, cu)
        current[fn] = factory
        return fn

    monkeypatch.setattr(bv, "_pass_fn", pass_fn)
    report = bv.run(cfg, timer, device="cpu", passes=("fwd",), rounds=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [(r.backend, r.status, r.median_ms) for r in report.results] == [
        ("a", "ok", 2.0), ("b", "ok", 4.0), ("c", "ok", 1.0)]
    assert all(r.checked.startswith("out: ok") for r in report.results)


def test_bench_cli_varlen_option_errors(capsys):
    pytest.importorskip("rich")  # the bench extra; without it the CLI stops earlier, asking for it
    from hopper_flash.bench import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--varlen", "8:x"])
    assert e.value.code == 2
    assert "--varlen takes LO:HI" in capsys.readouterr().err


# ---------------------------------------------------------------- fast launches (kernels faked)

def _same_arg(name, got, want):
    from hopper_flash import launcher

    if name.endswith("_desc"):
        assert isinstance(got, launcher.TmaArg), name
        assert tuple(got.shape) == tuple(want.shape) and tuple(got.strides) == tuple(want.strides), name
        assert got.base.dtype == want.base.dtype, name
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, name
    else:
        assert got == want, name


def _check_fast_equals_jit(log, arg_names):
    """log: [jit (first), fast (second call), jit (second call's shapes with the fast path off)]."""
    assert [e[0] for e in log] == ["jit", "fast", "jit"]
    _, grid, args, kwargs = log[2]
    fast = log[1][1]
    assert fast[:3] == tuple(grid) and fast[3] == 7
    bound = dict(zip(arg_names, args))
    bound.update({n: v for n, v in kwargs.items() if n in arg_names})
    assert set(bound) == set(arg_names)
    fast_args = fast[9:]
    assert len(fast_args) == len(arg_names)
    for name, got in zip(arg_names, fast_args):
        _same_arg(name, got, bound[name])


@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_varlen_fast_launch_binds_what_the_jit_binds(monkeypatch, d, seqused):
    from hopper_flash import plan
    from hopper_flash.kernels import forward as fk

    log = []
    monkeypatch.setattr(fk, "attention_forward_kernel", FakeJIT(log))
    monkeypatch.setattr(plan, "driver", FakeDriver)
    monkeypatch.setattr(plan, "_COMPILED", {})
    monkeypatch.setattr(plan, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(plan, "_plan_varlen", plan._plan_varlen.__wrapped__)

    def launch(lq, lk):
        q, k, v, cq, ck = problem(lq=lq, lk=lk, h=8, hkv=2, d=d)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0])
        uq = torch.tensor([min(n, 3) for n in lq], dtype=torch.int32) if seqused else None
        uk = torch.tensor([min(n, 2) for n in lk], dtype=torch.int32) if seqused else None
        plan.launch_forward_varlen(q, k, v, out, lse, cq, ck, uq, uk, max(lq), max(lk), 0.125, True)
        return q

    launch([5, 9], [7, 3])
    q = launch([130, 1, 64], [7, 300, 2])
    monkeypatch.setattr(plan, "FAST_LAUNCH", False)
    launch([130, 1, 64], [7, 300, 2])
    _check_fast_equals_jit(log, _REAL_FORWARD_ARG_NAMES)
    kwargs = log[0][3]
    assert kwargs["VARLEN"] is True and kwargs["SEQUSED_Q"] is seqused and kwargs["SEQUSED"] is seqused
    fast = log[1][1][9:]
    names = list(_REAL_FORWARD_ARG_NAMES)
    assert fast[names.index("total_q")] == q.shape[0]
    assert fast[names.index("seqlen_q")] == 130  # max_seqlen_q: the tile count


from hopper_flash.kernels import forward as _fk  # noqa: E402
from hopper_flash.kernels import backward as _bk  # noqa: E402

_REAL_FORWARD_ARG_NAMES = _fk.attention_forward_kernel.arg_names
_REAL_BACKWARD_ARG_NAMES = _bk.attention_backward_kernel.arg_names


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_varlen_fast_launch_binds_what_the_jit_binds(monkeypatch, d, deterministic):
    from hopper_flash import plan, plan_backward

    log = []
    monkeypatch.setattr(_bk, "attention_backward_kernel", FakeJIT(log))
    monkeypatch.setattr(plan_backward.SmallLaunch, "__call__", lambda self, pointers: None)
    monkeypatch.setattr(plan, "driver", FakeDriver)
    monkeypatch.setattr(plan_backward, "_COMPILED", {})
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 5)

    def launch(lq, lk):
        q, k, v, cq, ck = problem(lq=lq, lk=lk, h=8, hkv=2, d=d)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse = torch.empty(q.shape[1], q.shape[0])
        varlen = plan_backward.VarlenBatch(cq, ck, None, None, max(lq), max(lk))
        plan_backward.launch_backward(q, q, k, v, q, lse, dq, dk, dv, 0.125, True, deterministic, varlen=varlen)
        return q, k, dk

    launch([5, 9], [7, 3])
    q, k, dk = launch([130, 1, 64], [7, 300, 2])
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", False)
    launch([130, 1, 64], [7, 300, 2])
    _check_fast_equals_jit(log, _REAL_BACKWARD_ARG_NAMES)
    names = list(_REAL_BACKWARD_ARG_NAMES)
    fast = log[1][1][9:]
    assert fast[names.index("dk_ptr")] is dk
    assert fast[names.index("stride_kv_row")] == k.stride(0) and fast[names.index("stride_kv_head")] == k.stride(1)
    assert fast[names.index("seqlen_q_rounded")] == varlen_padded_rows(q.shape[0], 3,
                                                                   plan_backward.BACKWARD_CONFIGS[d].block_m)
    grid = log[2][1]
    # One item per (KV tile of max_seqlen_k, KV head, sequence), all on axis
    # x: one CTA each, or in the fast mode at D = 128 a persistent grid of at
    # most one CTA per SM (5 here) that loops over them.
    tiles = -(-300 // plan_backward.BACKWARD_CONFIGS[d].block_n)
    persistent = d == 128 and not deterministic
    assert tuple(grid) == (min(tiles * 2 * 3, 5) if persistent else tiles * 2 * 3, 1, 1)
    assert fast[names.index("kv_tiles")] == tiles and fast[names.index("batch")] == 3
    kwargs = log[0][3]
    assert kwargs["VARLEN"] is True and kwargs["DETERMINISTIC"] is deterministic
    assert kwargs["PERSISTENT"] is persistent
