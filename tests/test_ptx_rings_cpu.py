"""``hopper_flash.ptx_rings`` on PTX text: which barriers go, and when none do.

The PTX below is a hand-made excerpt in the form triton 3.6 emits (a
``.loc`` of the mbarrier call, then the membar pass's ``bar.sync``, then the
call's inline asm); the compile checks (``test_compile_sm90``) hold the
rewrite to the real kernels."""
from hopper_flash import ptx_rings

WAIT, ARRIVE = ptx_rings.ring_lines()
FILES = """
	.file	1 "/x/hopper_flash/kernels/forward.py"
	.file	4 "/x/hopper_flash/kernels/pipeline.py"
"""


def ring_wait(bar="0"):
    return f"""	.loc	4 {WAIT} 61
	bar.sync 	{bar}, 128;
	// begin inline asm
	mbarrier.try_wait.parity.shared.b64 complete, [%r1], %r2;
	// end inline asm
"""


def ring_release(bar="0"):
    return f"""	.loc	4 {ARRIVE} 20
	bar.sync 	{bar}, 128;
	// begin inline asm
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r3];
	// end inline asm
"""


def other_arrive(bar="0"):
    """An arrive from another source line (say, a Q slot's release)."""
    return f"""	.loc	1 670 9
	bar.sync 	{bar}, 128;
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r4];
"""


STEP = "$L__BB0_5:\n" + ring_wait() + "\twgmma.commit_group.sync.aligned;\n" + ring_release()


def test_the_ring_barriers_go_and_the_others_stay():
    ptx = STEP + other_arrive() + FILES
    out, n = ptx_rings.strip(ptx)
    assert n == 2
    assert out.count("bar.sync") == 1 and "\t.loc\t1 670 9\n\tbar.sync \t0, 128;" in out
    assert out.count("mbarrier.") == ptx.count("mbarrier.") and out.count(".loc") == ptx.count(".loc")


def test_another_files_lines_are_not_taken():
    ptx = STEP.replace("\t.loc\t4 ", "\t.loc\t1 ") + FILES
    assert ptx_rings.strip(ptx) == (ptx, 0)


def test_without_line_information_nothing_changes():
    ptx = "".join(line + "\n" for line in STEP.splitlines() if ".loc" not in line) + FILES
    assert ptx_rings.strip(ptx) == (ptx, 0)


def test_an_unguarded_shared_memory_access_keeps_every_barrier():
    # A warpgroup's generic shared-memory store whose first barrier on the
    # way forward is a ring barrier: taking that barrier out could unorder it
    # against a later access, so the kernel keeps all of triton's.
    ptx = STEP + "\tst.shared.b32 \t[%r9], %r10;\n" + ring_wait() + "\tbar.sync \t0, 128;\n" + FILES
    assert ptx_rings.strip(ptx) == (ptx, 0)


def test_a_loop_back_to_a_ring_barrier_counts():
    # The store's fall-through path meets a kept barrier, but its loop's back
    # edge leads to the next step's ring wait first.
    loop = STEP + "\tst.shared.b32 \t[%r9], %r10;\n\t@%p3 bra \t$L__BB0_5;\n\tbar.sync \t0, 128;\n"
    ptx = loop + FILES
    assert ptx_rings.strip(ptx) == (ptx, 0)
    # With a barrier of its own after the store, the loop is the rewrite's.
    guarded = loop.replace("[%r9], %r10;\n", "[%r9], %r10;\n\tbar.sync \t0, 128;\n")
    assert ptx_rings.strip(guarded + FILES)[1] == 2


def test_control_flow_it_cannot_read_keeps_every_barrier():
    ptx = STEP + "\tst.shared.b32 \t[%r9], %r10;\n\t@%p3 bra \t$L__BB9_9;\n\tbar.sync \t0, 128;\n" + FILES
    assert ptx_rings.strip(ptx) == (ptx, 0)


def test_a_guarded_access_does_not_stop_it():
    guarded = "\tbar.sync \t0, 128;\n\tstmatrix.sync.aligned.m8n8.x4.shared.b16 [%r8], {%r1, %r2, %r3, %r4};\n" \
              "\tbar.sync \t0, 128;\n"
    ptx = STEP + guarded + ring_wait() + FILES
    out, n = ptx_rings.strip(ptx)
    assert n == 3 and out.count("bar.sync") == 2


def test_another_warpgroups_access_is_its_own():
    # An access after a barrier of another warpgroup (named barrier 1) is not
    # this warpgroup's business, whatever follows it.
    ptx = STEP + "\tbarrier.sync \t1;\n\tld.shared.b8 \t%r1, [%r2];\n\t@%p2 bra \t$L__BB0_4;\n" + FILES
    assert ptx_rings.strip(ptx)[1] == 2


def test_the_hook_is_scoped_and_chained():
    from triton import knobs

    calls = []
    before = knobs.runtime.add_stages_inspection_hook

    def previous(*args):
        calls.append(args)
        return None if args else ("theirs", "0")

    knobs.runtime.add_stages_inspection_hook = previous
    try:
        with ptx_rings.compiling(0):  # a specialisation that keeps triton's barriers
            assert knobs.runtime.add_stages_inspection_hook is previous
        with ptx_rings.compiling(ptx_rings.VERSION):
            hook = knobs.runtime.add_stages_inspection_hook
            stages = {"ptx": lambda src, metadata: STEP + FILES}
            hook(None, stages, None, None, 90)
            assert len(calls) == 1  # the previous hook ran
            assert stages["ptx"](None, {"name": ptx_rings.KERNEL}).count("bar.sync") == 0
            assert stages["ptx"](None, {"name": "other_kernel"}).count("bar.sync") == 2
            # triton 3.9 asks the hook (no arguments) what to add to the cache key.
            key, digest = hook()
            assert key == "theirs" + ptx_rings.PIPELINE_KEY and digest != "0"
        assert knobs.runtime.add_stages_inspection_hook is previous
    finally:
        knobs.runtime.add_stages_inspection_hook = before


def test_the_launches_key_their_kernels_by_the_rewrite():
    # Triton 3.6 keys its cache on the source and the constexprs alone: the
    # kernels must carry which form of the rewrite compiled them.
    from hopper_flash import plan

    on = ptx_rings.VERSION if ptx_rings.ACTIVE else 0
    for cfg in plan.CONFIGS.values():
        # Head dim 256 keeps triton's barriers (ptx_rings.version_for).
        want = 0 if cfg.head_dim == 256 else on
        assert plan.kernel_constexprs(cfg, True, False)["RING_PTX"] == want
        split = plan.kernel_constexprs(cfg, True, True, plan.Mode(pack_g=4, split=True, seqused=True))
        assert split["RING_PTX"] == want
    assert ptx_rings.VERSION > 1
