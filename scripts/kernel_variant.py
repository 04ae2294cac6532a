"""Build a measurement-only variant of the kernels as a patched copy of the
package, so the shipped source carries no experiment switches.

    python scripts/kernel_variant.py NAME OUTDIR      # copies hopper_flash/, applies scripts/variants/NAME.patch
    PYTHONPATH=OUTDIR python -P -m hopper_flash.bench --config benchmarks/prefill.json --backends hopper_flash sdpa-cudnn

``-P`` (Python >= 3.11) matters: ``python -m`` otherwise puts the working
directory first on sys.path, and from the checkout's top the shipped package
there shadows the copy on PYTHONPATH (a whole screening in the fourth session
timed the shipped kernel under four names that way). The bench header's
"imported from" line says which package ran.

pytest needs more: pyproject's ``pythonpath = ["."]`` puts the checkout
first on sys.path inside pytest, ``-P`` or not, so a variant's tests run as
``PYTHONPATH=OUTDIR python -P -m pytest -o pythonpath=OUTDIR ...``
(``scripts/device_session.sh variant`` does); the pytest header line
"hopper_flash imported from" says which package ran. (The fifth session's
"fa3-pingpong: 189 passed" ran the shipped package that way.)

Time the variant in its own process next to SDPA cuDNN, and the shipped
package the same way right before or after it on the same machine; compare
the ratios to cuDNN. Variants (``scripts/variants/``):

* ``k-ahead-of-v``: the producer issues K[it + 1] before V[it] (FA3's order,
  shared/notes/fa3-forward.md section 7) instead of K[it], V[it].
* (``fa3-pingpong``, FA3's ping-pong, the two consumers taking turns to
  issue their steady-state QK + PV pair through an mbarrier: measured 1-2%
  slower at S>=8192 causal in the fifth session; removed in the twelfth,
  whose offset start conflicted with it. Its last text: ``git show
  d0b8571:scripts/variants/fa3-pingpong.patch``. ``fwd-pingpong-overlap``
  below is its named-barrier form on the current kernel.)
* ``combine-one-shot`` (seventy-fourth session): the split-KV combine loads
  every split's O at once beside the LSEs when there are at most 16 splits,
  instead of split by split after them. Refused: on an H100 under graph
  replay (``scripts/decode_splits.py --combine-cost``, alternating with
  main) the whole B8 decode calls ran 1.6-1.8 us slower (51.4 against
  49.8 us over 4096 keys) with the combine alone level (1.7 against 1.6),
  and as written it dropped a split whose LSE is NaN (``w > 0`` selects it
  away), where the reference and main give NaN: two graph-replay tests
  whose new lengths reach NaN keys failed on it.
* ``combine-rows`` (seventy-fourth session): the split-KV combine with 2
  or 4 output rows a program (``plan.COMBINE_ROWS``; 4 with twice the
  warps), so that fewer combine CTAs wait on the split grid's free SMs
  (PDL). Refused: on an H100 (``decode_splits.py --combine-cost``) the
  combine alone went from 1.6 to 1.8 / 2.1 us at B8 and from 2.3 to 4.9 /
  5.2 us at B1 over 65536 keys (15 splits), the whole calls 0.3-3.2 us
  slower: one row a program is the fastest of the three.
* ``fwd-pdl-all`` (seventy-fifth session): made the shipped code by branch
  ``pdl-late`` (seventy-sixth session: the late trigger; seventy-seventh:
  only runs whose grid fills every SM launched dependent, besides split
  runs, ``plan.launched_dependent``), where the patch is gone.
* ``append-pdl`` (seventy-fifth session; refused in the seventy-sixth:
  the whole call level with the shipped one, 54.1-54.2 against 54.0-54.1
  us at B8 over 4096 keys, H100, BENCHMARKS.md): the KV cache's
  append kernel lets the attention after it be scheduled from its start
  (``griddepcontrol.launch_dependents``), so a decode step's split run,
  launched dependent on the append since that session, gets its CTAs
  resident and its prologue done while the append runs. Times a decode
  step with a one-token append: ``pscreen scripts/decode_splits.py
  --combine-cost --append`` against the shipped package (the
  ``--combine-cost`` split figures are then the append's and the split
  kernel's). Shipping it needs a constexpr off in the interpreter tests
  (``tests/test_append_cpu.py``: no inline assembly there).
* ``timeline``: the consumers write the SM's clock at seven points of each
  work item into a buffer (plan.TRACE); ``scripts/timeline.py`` runs it and
  prints where an item's time goes (waiting for Q or the first K, the
  prologue, the steady steps, the last PV, the epilogue, between items);
  three consumer slots per CTA, and ``--wide`` runs the wide tiles at every
  length.
* ``fwd-step-timeline`` (sixteenth session): ``timeline`` plus five clocks
  per steady step (steps 1..48 of each consumer's first item: loop head,
  K/V landed, QK complete, softmax done, O rescaled), placed where they
  keep the shipped SASS order (a clock between the softmax and the PV wait
  stops ptxas hoisting that wait, which changes the schedule being
  measured; at head dim 128, ``MAX_BEFORE_PV``, the "softmax done" clock
  is PV complete after the row maximum, and the exponentials fall before
  "O rescaled"); ``scripts/step_timeline.py`` prints the phases and how a
  CTA's consumers sit against each other in time.
* (``fwd-softmax-timeline``: ``fwd-step-timeline`` plus two clocks inside the
  softmax, which moved ptxas's PV wait after the exponentials (so it measured
  the softmax-overlaps-PV schedule); removed in the thirty-sixth session, when
  head dim 128's step moved its PV wait after the row maximum
  (``MAX_BEFORE_PV``) under it; its text: ``git show
  4328e42:scripts/variants/fwd-softmax-timeline.patch``.)
* (``varlen-wide64`` and ``varlen-wide64-long``, fifty-sixth and
  fifty-seventh sessions: head dim 64's 192-row tiles in every varlen
  launch whose pages are not gathered, and only in unpaged, unsplit
  launches whose ``max_seqlen_q`` reaches ``WIDE_MIN_ROWS``. The second
  shipped in the fifty-eighth session (``plan._plan_varlen``, windows
  excluded); the first measured 5-12% slower on batches of 128-2048
  tokens. Their text: ``git show 5164985:scripts/variants/varlen-wide64.patch``.)
* ``bwd-timeline`` (the backward): the split-keys consumers (D = 64, 128)
  write the SM's clock at nine points of each step and at a CTA's start,
  K/V arrival and end into a buffer (``plan_backward.TRACE``);
  ``scripts/bwd_timeline.py`` runs it and prints where a step's time goes.
  Since the forty-first session it also records each CTA's SM, for the
  gap between consecutive CTAs on one SM. Fixed lengths run one CTA per
  tile in it (the shipped kernel's short causal rows run persistent since
  the forty-second session; the trace is per CTA).
* ``bwd-persistent-timeline`` (forty-first session, run in the
  forty-second): ``bwd-timeline`` on the persistent grid at D = 128 for
  every fixed-length fast call, traced per item (KV tile) instead of per
  CTA, steps counted from each item's first: where a tile's time goes on
  the persistent grid, against ``bwd-timeline``'s one CTA per tile. On the
  device: ``python scripts/kernel_variant.py bwd-persistent-timeline
  /tmp/ptl && PYTHONPATH=/tmp/ptl python -P scripts/bwd_timeline.py
  --seqlen 2048 8192``, and the same for ``bwd-timeline``. Forty-second
  session (B4 H32 causal D128): the gap between two tiles on an SM ~815
  cycles against ~1850, the K/V wait ~115 against ~2860, but steps ~4.5%
  longer (median 3898 against 3728 cycles) and the epilogue ~1200 longer
  (BENCHMARKS.md).
  With ``BWD_CTAS`` at least the item count it runs one CTA per item
  (each CTA's first draw returns at least the grid size, past the last
  item): the persistent kernel's code on the one-CTA grid. Forty-third
  session (an equivalent hand edit, BENCHMARKS.md): its step takes 3880 cycles there against 3897 on the
  persistent grid and 3730 for ``bwd-timeline``: the code, not the grid,
  makes the step slower (BENCHMARKS.md).
* (``bwd-persistent-ctas``, forty-second session, screened in the
  forty-third: the persistent grid on every fast D = 128 call with at most
  ``BWD_CTAS`` CTAs. At 112 CTAs the backward is 8-12% slower than the
  shipped kernel at S = 1024-8192 causal; the step's cycles do not change
  with the CTA count (``bwd-persistent-timeline`` at 112 and 100 CTAs:
  3898, as at 132), so the memory side's load is not why a step is slower
  there. Its text: ``git show 5c89ff8:scripts/variants/bwd-persistent-ctas.patch``.
  ``bwd-persistent-timeline`` keeps ``BWD_CTAS``.)
* (``bwd-d64-varlen-dq1``, forty-second session, screened in the
  forty-third: head dim 64's varlen kernels stage dQ in one tile instead of
  two (the causal step loop's local accesses 12 -> 5 in the CPU census).
  Tests passed (54); the varlen backward 10.055 / 10.067 ms against the
  shipped 10.011 / 10.007, no gain (16 sequences, D = 64, FA3 8.76). Its
  text: ``git show 5c89ff8:scripts/variants/bwd-d64-varlen-dq1.patch``.)
* (``bwd-varlen-lpt``, forty-second session, screened in the forty-third:
  the varlen backward's persistent grid takes every (sequence, KV tile)
  pair longest first within each KV head, from a table an extra rank
  kernel writes. The model predicted 0.4% faster; measured 3% slower
  (15.95 / 15.96 ms against the shipped order's 15.46 / 15.44, 16
  sequences; tests passed, 54). The model has no L2: the shipped order
  keeps a sequence's Q and dO hot across its tiles. Its text: ``git show
  5c89ff8:scripts/variants/bwd-varlen-lpt.patch``.)
* (``bwd-persistent-fixed``, forty-first session, screened in the
  forty-second: the persistent grid on every fixed-length fast call at
  D = 128. 2-6% faster on causal rows of 1024-4096 queries, within ±2% at
  causal S = 8192 and GQA S = 8192, 1% slower non-causal S = 8192; shipped
  for causal rows of at most 4096 queries (``plan_backward.persistent_grid``).
  Its text: ``git show f165cef:scripts/variants/bwd-persistent-fixed.patch``.)
* (``bwd-persistent``, written in the fortieth session, timed in the
  forty-first: the fast backward at D = 64/128 on a persistent grid. 1.0-1.4%
  faster on the D = 128 varlen block, and shipped there (varlen fast mode at
  D = 128, ``PERSISTENT``); 4-5% slower on the D = 64 varlen block; on fixed
  lengths 1.6-4.7% faster on short rows (S = 1024, 2048) and 1-2% slower on
  long ones (S = 8192, GQA). Not shipped there (BENCHMARKS.md). Its text: ``git show
  ce39ea5:scripts/variants/bwd-persistent.patch``.)
* (``bwd-dq-writer``, a dQ writer warp in a third partition, FA3's shape of
  the dQ path: correct, but 1-2% slower at D = 128 (tenth session); removed
  when the backward's arguments became aggregates. Its last text:
  ``git show d0b8571:scripts/variants/bwd-dq-writer.patch``.)
* (``bwd-st-early`` and ``fwd-d256-rescale-early`` were timed in the twelfth
  session, both slower than the shipped kernels, and removed: BENCHMARKS.md;
  their text is in d0b8571.)
* (``fwd-offset-first-item`` and ``bwd-exp-overlap`` were timed in the
  thirteenth session and removed: BENCHMARKS.md. The first took the offset
  start at a CTA's first item only, causal items too: within noise. The
  second moves the backward's dPᵀ wait, which ptxas hoists to the top of
  its basic block, after Pᵀ's exponentials: 3-4% slower. Its text: ``git
  show a5d7a1a:scripts/variants/bwd-exp-overlap.patch``.)
* (``fwd-softmax-overlap``: ``PV_AFTER_SOFTMAX`` in every specialisation:
  within +-2% at D = 128 and 3-4% slower on the two-consumer D = 64 tiles
  (thirteenth and twenty-first sessions); removed in the thirty-sixth session,
  when head dim 128's step moved its PV wait after the row maximum
  (``MAX_BEFORE_PV``) under it; its text: ``git show
  4328e42:scripts/variants/fwd-softmax-overlap.patch``.)
* ``fwd-split-merge`` (twenty-first session; timed in the twenty-second:
  correct, 0.6-4 us slower than the shipped split + combine, BENCHMARKS.md): split-KV
  without the combine kernel. After writing its partials, each consumer
  warpgroup of a split counts its arrival on an int64 counter per row
  block, kept after the partials in the per-call workspace (``sched_ptr``,
  unused in split mode); the counter's high half carries a per-launch
  token (``section``, unused too), so a fresh workspace's garbage counts as
  no arrival and no memset is needed; the last split merges every split's
  partials for its live rows (four rows and 16 splits per load, so one L2
  round trip per four rows), writes O (``cu_q_ptr``, i.e. O, contiguous
  BSHD; the host gives a non-contiguous ``out`` a temporary) and the LSE,
  and resets the counter to 0, which keeps CUDA-graph replays (their token
  is fixed) correct. Fences: ``fence.acq_rel.gpu`` around a warpgroup
  barrier before the arrive and after it; partials loaded with ``.cg``.
  Spill-free at D = 128 with PackGQA 4 (issue 10's rows); D = 256 and
  paged PackGQA 8 spill 8-16 bytes. What it should save: the 2.3-3.5 us
  the combine costs a one-row decode call (BENCHMARKS.md, twenty-first
  session) and its launch's host time. What it did instead: the merge runs
  on one SM after the slowest split of its row block.
* (``fwd-split-pdl``, written in the twenty-third session, timed in the
  twenty-fourth and shipped: the combine by programmatic dependent launch,
  triggered at the split kernel's start; -0.8 us on the B=1 split row,
  BENCHMARKS.md.)
* ``fwd-next-item-early`` (twenty-first session; timed in the twenty-second:
  within noise, 3% slower at D128 causal S8192, BENCHMARKS.md): the
  consumers receive (dynamic order) or count (static deal) their next item
  and decode its coordinates right after issuing the item's last PV, inside
  an ``if`` so that ptxas cannot hoist the PV wait above them, instead of
  after the epilogue. The timeline (BENCHMARKS.md, twenty-first session)
  has ~600 cycles per item (static) and ~830 (dynamic) between items, most
  of it the run-time integer divisions of that decoding; in the variant's
  SASS 46-78 integer instructions of it sit between the last PV's HGMMAs
  and their wait (D=128). Spill-free but for D=256 varlen (a measurement
  variant: its varlen D=256 rows would time a spilling kernel).
* (``fwd-pingpong-overlap``, twenty-first session: FA3's schedule, its
  ping-pong and its intra-warpgroup overlap together, every GEMM issue of an
  item a turn passed between the two consumers through named barriers.
  Within +-2% of the shipped kernel at D = 128 on the old schedule
  (twenty-first session); on ``MAX_BEFORE_PV``, where the turns complete
  FA3's schedule, 0.8-2.8% slower on every D = 128 row (thirty-seventh
  session). Removed then; its text: ``git show
  2814fef:scripts/variants/fwd-pingpong-overlap.patch``.)
* (``fwd-pingpong-nobar``, thirty-ninth session: ``fwd-pingpong-overlap``
  again on the forward whose steady K/V ring lost triton's named barriers
  (``ptx_rings``): still 0-1.5% slower on the D = 128 rows (BENCHMARKS.md,
  thirty-ninth section). Removed; its text: ``git show
  b2df98c:scripts/variants/fwd-pingpong-nobar.patch``.)
* (``fwd-mask-loop-split``, thirty-ninth session: the steady steps in two
  loops, the masked ones first, then the rest with no per-step
  ``tile_needs_mask``. Refused on the CPU in the fortieth, untimed: its
  unmasked loop runs 513 SASS instructions a step, 64 of them ``PRMT``
  swapping the halves of P's registers before the PV wgmmas, against the
  shipped loop's ~454 on its unmasked path (the mask block is branched
  over; the per-step mask decision is ~5 instructions). Its text: ``git
  show b16aaab:scripts/variants/fwd-mask-loop-split.patch``.)
* (``fwd-max-before-pv-all`` and ``fwd-max-before-pv-wide``, thirty-sixth
  and thirty-seventh sessions: ``MAX_BEFORE_PV`` in every specialisation,
  then on the wide tiles alone. Screened in the thirty-seventh: +2-4% on
  the wide tiles (shipped), 0.6-2% slower at head dim 256 and on head dim
  64's two-consumer tiles (S = 2048 causal and S = 1024 non-causal -2%,
  S = 1024 causal +1%), which keep their forms. Their text: ``git show
  2814fef:scripts/variants/fwd-max-before-pv-all.patch`` and the
  thirty-seventh session's branch ``wide-max-before-pv``.)
* ``fwd-d128-wide`` (thirty-third session; screened in the thirty-fourth,
  +3% non-causal S = 8192, slower elsewhere; its three consumers keep the
  softmax beside their own PV, ``PV_AFTER_SOFTMAX``, where head dim 64's
  three-consumer tiles now take ``MAX_BEFORE_PV``):
  head dim 128 on the wide tiles, three consumer warpgroups of 64 rows on
  192-row items (``plan.WIDE_CONFIGS[128]``; ``plan.choose_wide`` then
  picks them for long plain prefill as at head dim 64), with P staged in
  shared memory for an SS PV (``Mode.P_SMEM``: S, P and O in registers
  would take 160 of a consumer's 160; stmatrix stores and a proxy fence,
  FA3's SS path). The idea: with two consumers a step is ~2530 cycles
  against its GEMMs' 2048, about one warpgroup's GEMMs (1024) plus its
  softmax path (~1500) that the other consumer's GEMMs cannot cover; with
  three, the other two's GEMMs (2048 cycles) cover it. Shared memory
  229,852 of 231,424 bytes (one Q slot, O staged in Q's rows). Census under
  triton 3.6: stack 32-96 bytes, spills outside the steady step (0-1 spill
  instructions in the step without the LSE, 4-12 with it). Its own GPU
  tests ship in the copy: ``hopper_flash/test_wide_d128_gpu.py`` (the wide
  tiles at every length, NaN-poisoned outputs, the LSE, a bitwise rerun).
  Time it with ``--variant block_m=192,consumer_regs=160,producer_regs=32,maxnreg=128``
  (every row on the wide tiles) on ``benchmarks/wide-d128.json``, the
  shipped package in an alternating process (BENCHMARKS.md, thirty-third
  session, has the commands).
* (``fwd-kv192``, fourteenth session: a 192-key KV step for plain D = 128
  prefill as two score tiles, 128 + 64 keys; correct (302 GPU tests) but
  2-14% slower than the shipped 128-key step, BENCHMARKS.md. Its text:
  ``git show 37406b0:scripts/variants/fwd-kv192.patch``.)
* (``fwd-lane-row-sums``, per-thread row sums, shipped in the fifteenth
  session: ``kernels/softmax.py``.)
* (``fwd-lazy-rescale``: FA4's conditional O rescale: +3-4% causal D = 128,
  +8-11% at D = 256, but 2-4% larger output error than cuDNN's and FA3's, so
  not shipped (fifteenth session); removed in the thirty-sixth session, when
  head dim 128's step moved its PV wait after the row maximum
  (``MAX_BEFORE_PV``) under it; its text: ``git show
  4328e42:scripts/variants/fwd-lazy-rescale.patch``.)
* ``fwd-ring-arith`` (fifteenth session, CPU only, not run; written by a
  helper): ring slots and phases in unsigned arithmetic (``order`` is never
  negative: no sign fix-ups), and the forward consumer's K/V subviews taken
  before the waits, so less descriptor arithmetic follows them. Results
  unchanged by construction (address bookkeeping only). Steady-loop SASS
  outside the mask branch: D = 128 466 -> 456 instructions (uniform ops
  59 -> 49; wait-to-first-HGMMA 14 -> 10 slots), D = 64 420 -> 414, D = 256
  418 -> 416, wide D = 64 452 -> 446; forward census identical, no spills;
  the backward (which shares ``pipeline.py``) spills less in the specs that
  already did. Loop-carried slots cut a few more but made a D = 256 varlen
  kernel spill (not kept). Timed in the sixteenth session (screen beside
  FA3): within noise of the shipped kernel (-1% to +0.5%); not shipped.
* (``fwd-thread-arrive``: every consumer thread releasing its K and V slots
  itself, 3 ``BAR.SYNC`` per step -> 1; removed in the thirty-sixth session,
  when head dim 128's step moved its PV wait after the row maximum
  (``MAX_BEFORE_PV``) under it; its text: ``git show
  4328e42:scripts/variants/fwd-thread-arrive.patch``.)
* (``fwd-rescale-skip``: the O rescale skipped per warp where exact; removed
  in the thirty-sixth session, when head dim 128's step moved its PV wait
  after the row maximum (``MAX_BEFORE_PV``) under it; its text: ``git show
  4328e42:scripts/variants/fwd-rescale-skip.patch``.)
* (``fwd-arrive-skip``: both of the above. All three passed the GPU suite but
  ran D = 128 1-4% slower (sixteenth session); removed in the thirty-sixth
  session, when head dim 128's step moved its PV wait after the row maximum
  (``MAX_BEFORE_PV``) under it; its text: ``git show
  4328e42:scripts/variants/fwd-arrive-skip.patch``.)
* (``fwd-ring-nobar``, thirty-eighth session: the forward kernel's PTX
  rewritten at compile time without the ``bar.sync`` triton 3.6's membar
  pass puts before every ``pipeline.wait_full`` and ``pipeline.release``;
  +2.7% at D = 128 causal S = 8192, BENCHMARKS.md. Its shipped form is
  ``hopper_flash/ptx_rings.py``, which takes only the steady steps'
  ``wait_landed`` / ``release_read`` barriers; the variant's text: ``git
  show a52b63c:scripts/variants/fwd-ring-nobar.patch``.)
* ``bwd-dq-red`` (sixteenth session): the split-keys backward consumers
  (D <= 128) add their dQ shares into ``dq_accum`` straight from registers
  (``gl.atomic_add``, relaxed: 32 ``REDG`` per thread and step, in
  ``_stage_dq``'s interleaved row order) instead of staging them in shared
  memory for a TMA reduce-add: 64 KB less shared-memory traffic per D = 128
  step (of ~368 KB, the eighth session's count) and no staging barrier.
  Deterministic mode keeps the staged, ordered adds. The non-deterministic
  ``sem_ptr`` carries ``dq_accum`` (host side, ``plan_backward``).
  Correct (122 GPU tests) but 18-22% slower on every D = 128 row (the
  scalar REDs at ~2 TB/s swamp L2): **not shipped** (BENCHMARKS.md,
  sixteenth session). ``test_compile_backward``'s TMA-reduce check fails on
  it by design.
* (``fwd-qk-first``: the O rescale applied while QK runs (FA3's place for D >
  128): within noise at S = 8192, 1-2% slower at S = 2048 (sixteenth session);
  removed in the thirty-sixth session, when head dim 128's step moved its PV
  wait after the row maximum (``MAX_BEFORE_PV``) under it; its text: ``git
  show 4328e42:scripts/variants/fwd-qk-first.patch``.)
* (``fwd-tree-max``: the row maximum as a tree: equal causal, 2-4% slower
  non-causal and at D = 256 (sixteenth session); removed in the thirty-sixth
  session, when head dim 128's step moved its PV wait after the row maximum
  (``MAX_BEFORE_PV``) under it; its text: ``git show
  4328e42:scripts/variants/fwd-tree-max.patch``.)
* (``fwd-paired-steps``, sixteenth session: head dim 64 on two-consumer
  64-key tiles, two steps per loop body with the second tile's QK issued
  ahead. Seventeenth session on the H200: 14-20% slower on every D = 64 row;
  removed, text: ``git show 0ddd55d:scripts/variants/fwd-paired-steps.patch``.)
* ``fwd-exp2-split3`` (seventeenth session): the forward's probabilities
  ``exp2(s·c - m)`` with 3 of every 8 of a thread's registers computed by a
  degree-3 polynomial on the FMA pipes (FlashAttention-4's split) instead of
  MUFU.EX2 (``softmax.exp2_split``: clamp at -127, floor by adding 1.5·2^23
  rounded down, Horner in 3 FFMA, floor(x) added to the exponent with one
  integer multiply-add; max relative error 8.6e-5; -inf gives exactly 0).
  Set ``EXP2_EMULATED`` in the copy for other shares (2/8 and 4/8 were
  timed too). On the H200 **slower in proportion to the share** (-6 to -8%
  at 2/8, -16% at 4/8 on D = 128): the softmax phase is bound by its warps'
  instruction streams, not the SFU. Not shipped (BENCHMARKS.md, seventeenth
  session).
* (``fwd-q-regs``, seventeenth session: Q loaded into registers once per
  item and fed to every QK as the register A operand, a seventh of a D = 128
  step's shared-memory traffic gone; 338 GPU tests passed, timed within
  noise of the shipped kernel. Removed, text: ``git show
  0ddd55d:scripts/variants/fwd-q-regs.patch``.)
* ``bwd-rotate`` (eighteenth session; the twelfth timed the same by hand):
  without a causal mask, a window or deterministic mode, the backward's KV
  tile n walks its query tiles from tile 2n (mod) instead of 0, so that
  neighbouring CTAs add their dQ shares into different tiles. 118 GPU tests
  passed; within noise at D = 128, 1% slower at D = 64: the dQ reduce-adds
  do not contend. Not shipped (BENCHMARKS.md, eighteenth session).
* (``bwd-k-regs``, nineteenth session: K as the split-keys consumers' Sᵀ
  register operand (D = 128; the statistics then ride in the accumulators),
  so Sᵀ reads only Q from shared memory. It spills in the step loop; 16%
  slower. Refused (BENCHMARKS.md, nineteenth session); removed in the
  forty-fifth, when its patch no longer applied to ``_p_and_ds``: ``git
  show 9530717:scripts/variants/bwd-k-regs.patch``.)
* (``bwd-dq-double``, ``bwd-thread-arrive``: two dQ staging tiles, and every
  consumer thread arriving on the Q/dO empty barriers; shipped together in
  the nineteenth session, df202c8.)
* ``bwd-d256-arrive`` (nineteenth session): the D = 256 consumers release
  Q per thread (``release_each``) after the barrier they pass anyway: 8 -> 7
  ``BAR.SYNC`` per step, census as shipped. Releasing dO the same way
  without its barrier (8 -> 5) spilled 28 ``LDL`` per step. Twentieth
  session on the H200 (two rounds beside the shipped kernel): 0.5-1%
  slower at S = 8192, causal and not. Not shipped.
* ``bwd-dq-sts128`` (nineteenth session): the split-keys consumers stage
  dQ with rows and columns permuted so each thread writes 128-bit stores (8
  STS.128 per step where 16 STS.64 were; conflict-free in the 128-byte
  swizzle by construction), the postprocess reading the order back
  (``STS128``). The ncu samples put 16 STS.64 of the staging at ~7% of the
  consumers' samples (mio). D = 64's deterministic stack grows 48 -> 64
  bytes (over the census allowance); D = 256 keeps the old staging (the new
  one spilled there). Twentieth session on the H200: **2-5% slower** at
  D = 64 and 128, causal and not. Refused.
* (``bwd-det-one-tile``: one dQ staging tile in deterministic mode; shipped
  in the twentieth session after 109 backward and launch GPU tests.)
* (``fwd-causal-offset``, twenty-fifth session: the offset start
  (``forward._offset_start``) under a causal mask too, for the
  chunked-prefill rows. +1-3% there in the twenty-fifth session, noise or
  worse on square causal rows in the thirty-seventh, and on the
  forty-sixth session's kernel -0.7% on the 128 x 8192 row it was meant
  for; removed. Its text: ``git show
  c8a39df:scripts/variants/fwd-causal-offset.patch``.)
* (``fwd-carry-qk``, removed in the thirty-second session, when the
  kernels took attention sinks in their epilogue, which the variant had cut
  into pieces; its last text: ``git show
  611da01:scripts/variants/fwd-carry-qk.patch``.) (twenty-sixth session, branch ``carry-qk``): an item's
  first QK goes out with the last PV of the item before it
  (``_consumer_carried``: plain prefill with two Q slots and two consumers,
  the boundary between items as one more step; the consumer's item in
  pieces ``_first_scores``, ``_steps``, ``_store_item``). Forward and window
  GPU tests 321 passed. On the H200 (``benchmarks/carry.json``, two rounds
  beside the shipped kernel): 2-6% slower on short causal items (B4 H32
  S1024 401-403 against 410-413 TFLOP/s, S2048 499-507 against 532-533, B16
  H16 S512 266-272 against 284-288), level from S8192 on; without its wait
  for the next item's first V (which keeps the last PV's wait after the
  next item's exponentials) still 2-6% slower at S512-S2048. Not shipped
  (BENCHMARKS.md, twenty-sixth session).
* ``gather-whole-lines`` (twenty-eighth session): gathered pages (1-8
  keys) read eight threads to a row (whole 128-byte lines per copy
  instruction) instead of four, the producer given 56 registers and the
  consumers 224 (8 bytes of spill with the LSE). Pages of 8 0.90-0.95x the
  contiguous cache against the shipped 0.85-0.92x, pages of 1 0.71-0.82x
  against 0.84-0.91x (BENCHMARKS.md, twenty-eighth session).
* (Forty-fourth session, five backward variants timed and removed, their
  texts at ``git show 6690b0c:scripts/variants/NAME.patch``; BENCHMARKS.md
  has the figures. ``bwd-dq-buf-and`` (the dQ staging tile picked with
  ``step & 1``: the one change found on the CPU that gives the varlen
  persistent kernel the one-CTA kernel's exponential placement, 3 of 32
  ``MUFU.EX2`` before the dPᵀ wait) and ``bwd-step-assume``
  (``gl.assume(step >= 0)``: 10-19 fewer instructions a step): the varlen
  backward level (15.42/15.53 and 15.43/15.50 ms against 15.43/15.48).
  ``bwd-dq-writer``: FA3's dQ path, a writer warp in a third partition
  sending each step's dQ behind a named barrier per staging tile while the
  consumers go on (one CTA barrier a step fewer): 250 GPU tests passed,
  varlen level, fixed rows level to 4% slower (the tenth session's form
  with one staging tile: 1-2% slower). ``bwd-ds-before-dv`` (dSᵀ stored
  before dV is issued, so the store lands while dV issues): level on
  every row. ``bwd-lse-ahead`` (a step's L2 vector loaded at the end of
  the step before, away from the Sᵀ/dPᵀ operand reads that the
  exponentials' wait sits behind in Nsight Compute): 5 local accesses a
  step at D = 128, 3.6% slower.)
* (``bwd-dq-writer``, the forty-fourth session's dQ writer warp, restored
  in the forty-fifth and timed at head dim 64 in the forty-sixth: within a
  round's spread there, as at head dim 128 before; refused. Its text:
  ``git show c8a39df:scripts/variants/bwd-dq-writer.patch``.)
* (``bwd-d64-prescaled``, forty-fifth session, timed in the forty-sixth:
  the backward preprocess storing -L2/c and -Δ for head dim 64's
  128-query steps so the accumulators start at the loaded vectors; +1.5%
  without a mask, 4-5% slower under one, where its seven local accesses a
  step sit; refused. Its text: ``git show
  c8a39df:scripts/variants/bwd-d64-prescaled.patch``.)
* (``fwd-tree-max``, forty-sixth session: the row maximum as a tree in
  each thread, timed +1.9-2.8% at head dim 128 causal and -3.4% on head
  dim 64's two-consumer tiles; shipped for head dims 128 and 256 as
  ``softmax._row_max``'s ``TREE``. Its text: ``git show
  92829b9:scripts/variants/fwd-tree-max.patch``. ``fwd-tree-wide``, the
  tree on head dim 64's wide tiles too, timed level there (-0.9 to +0.8%);
  refused, ``git show 5b7230e:scripts/variants/fwd-tree-wide.patch``.)
* (``fwd-tree-sum``, forty-sixth session, timed in the forty-seventh: the
  softmax's per-thread row sums (``_lane_sums``) added as ``_row_max``'s
  tree at head dims 128 and 256, which shortened the step's longest
  dependency chain from 22 instructions to 13 (CPU; only triton 3.6/3.7
  builds change, 3.8+ lower ``gl.sum`` as a tree). 0.3-1.9% *slower* on
  every D = 128 row of a screen (two rounds, FA3 beside; BENCHMARKS.md,
  forty-seventh section): refused. Its text: ``git show
  8185856:scripts/variants/fwd-tree-sum.patch``.)
* (``fwd-pingpong-chunk``, forty-seventh session: ``fwd-pingpong-nobar``
  ported to the current forward (head dim 128, two consumers, plain
  modes), to time FA3's ping-pong on issue 10's chunked-prefill rows
  (one wave of 64-step items, not at the power cap, where a step's
  cycles show in the time), which no earlier screen of it had. Level
  there (+1.0% / -2.8% / +0.3% at 128 x 8192 / 16384 / 4096, noise), -4.2
  to +2.9% on the square rows: refused a fourth time. Its text: ``git
  show 8185856:scripts/variants/fwd-pingpong-chunk.patch``.)
* (``fwd-v-at-issue``, forty-seventh session: head dim 128's steady step
  waiting for the V of the PV it issues right before issuing it (FA3's
  place) in every mode. Chunked rows (one item per CTA) 5-9.6% faster,
  CTAs with several items 2-3.7% slower (BENCHMARKS.md, forty-seventh
  section): shipped for launches whose every CTA runs one item
  (``plan.Mode.one_item``, the kernel's ``V_AT_ISSUE``), byte-identical in
  SASS to this variant there. Its text: ``git show
  fe976fa:scripts/variants/fwd-v-at-issue.patch``.)
* (``fwd-tmap-prefetch``, forty-eighth session: the ``ptx_rings`` hook
  also inserted ``prefetch.tensormap`` for each TMA descriptor (Q, K, V, O;
  thread 0) at the forward kernel's entry, as FA3 and CUTLASS do before
  their first loads (head dims 64 and 128). Decode tests passed (88); on
  issue 10's decode block under graph replay level or 0.1-0.5 us slower
  (BENCHMARKS.md, forty-eighth section): refused. Its text: ``git show
  9e02afa:scripts/variants/fwd-tmap-prefetch.patch``.)
* (``fwd-l2-hints``, forty-eighth session: the ``ptx_rings`` hook also
  gave the forward's TMA loads FA3's L2 eviction hints
  (``.L2::cache_hint``; K and V ``EVICT_LAST``, Q ``EVICT_FIRST``, CUTLASS's
  encoded policies) at head dims 64 and 128. Decode tests passed (88);
  -1.3 to +1.4% on chunked, square, GQA, D = 64 and decode rows, noise
  (BENCHMARKS.md, forty-eighth section): refused. Its text: ``git show
  4a425e1:scripts/variants/fwd-l2-hints.patch``.)
* (``fwd-d256-kv80``, forty-eighth session, timed in the forty-ninth:
  FA3's 80-key K/V tiles at head dim 256 (ours: 64), as two score tiles
  of 64 and 16 keys (Gluon's shapes are powers of two), each K/V tile five
  TMA boxes of 16 keys, PV two wgmma groups. Its D = 256 forward tests
  passed (34); 5-10% slower than the shipped kernel on every row of
  ``benchmarks/d256.json`` (causal S = 8192 3.63 / 3.56 ms against 3.41 /
  3.35). FA3 itself built with 64-key tiles (``scripts/fa3_extra_build.sh
  d256n64``) is 1.8-3.3% slower than its own 80-key build at S = 8192: FA3 takes its tile
  as one ``m64n80`` wgmma, ours cost two groups and a two-part softmax
  (BENCHMARKS.md, forty-ninth section). Refused; its text: ``git show
  f749978:scripts/variants/fwd-d256-kv80.patch``, and the call that
  timed it, ``device_session.sh``'s ``fa3tiles`` mode: ``git show
  11869db:scripts/device_session.sh``.)
* (``fwd-pingpong3`` and ``fwd-pingpong3-own``, forty-ninth session: FA3's
  three-way ping-pong on head dim 64's wide tiles, each steady step's
  QK + PV issue a turn passed 0 -> 1 -> 2 -> 0 through named barriers
  8-10; the first without ``OWN_DIAGONAL`` (equal turns), the second
  keeping it with an empty turn per KV tile passed unread. Tests passed
  (48 each); causal S = 8192, GQA, S = 16384, fp16 and non-causal S = 2048
  level with the shipped kernel, non-causal S = 8192 1-1.5% faster: the
  causal row it was for (0.96-0.97x FA3) did not move (BENCHMARKS.md,
  forty-ninth section). Refused; their text: ``git show
  b8ceea2:scripts/variants/fwd-pingpong3.patch`` and
  ``...fwd-pingpong3-own.patch``.)
* ``fwd-offset-causal-wide`` (forty-ninth session; prepared, not run: the
  device machine stopped answering during its screen): the offset start
  (``forward._offset_start``: consumer c issues an item's first QK once
  consumer c - 1's has completed) under a causal mask on head dim 64's
  wide tiles only. ``fwd-causal-offset`` (above) let every causal launch
  take it and was timed on head dim 128's rows only; the wide tiles' causal
  items start with all three consumers waiting for one K tile and running
  their first softmax together (prologue ~5200 cycles against ~2600
  non-causal, thirty-fourth session's timeline), where D = 64 causal
  S = 8192 trails FA3 most (0.95-0.97x). Spill-free (CPU census, static and
  dynamic, with and without LSE). To screen: ``SCREEN_FA3=0 bash
  scripts/device_session.sh screen benchmarks/offset-causal.json
  fwd-offset-causal-wide`` (D = 64 causal: B8 S8192, B4 S16384, GQA
  S8192, fp16 S4096 and S8192).
* (``varlen-skip-dead``, twenty-ninth session: shipped in the forty-fifth
  as ``forward._skip_dead_run``.) ``varlen-compact-order`` (forty-fourth
  session; timed and removed in the forty-fifth, its text at ``git show
  5ef73ab:scripts/variants/varlen-compact-order.patch``): the varlen
  forward's dynamic order numbered over each sequence's own query tiles
  (``scheduler.varlen_coords``), so no item is dead. 65 GPU tests passed;
  as fast as the dead-item skip (BENCHMARKS.md, forty-fifth session) with
  five times its code and 12-17 local accesses at head dim 256.
  Its decode's Python check: ``git show 5ef73ab:scripts/varlen_order_check.py``.
* ``no-softmax``: an ablation with wrong results: the steady state's mask,
  softmax and O rescale are dropped (P = S), the GEMM issue order is kept.
  It tells how much of a step the softmax costs where it is not overlapped.

The bench checks every output against the reference, so an ablation's rows
read "wrong" there; only their times mean anything.

A patch that no longer applies after an edit of the kernel it changes fails
here with ``patch``'s message; regenerate it from an edited copy with
``diff -u a/hopper_flash/kernels/forward.py b/hopper_flash/kernels/forward.py``
(or ``backward.py``).
"""
import argparse
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = ROOT / "scripts" / "variants"


def main() -> int:
    names = sorted(p.stem for p in VARIANTS.glob("*.patch"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=names)
    ap.add_argument("outdir", type=pathlib.Path)
    args = ap.parse_args()
    dest = args.outdir / "hopper_flash"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ROOT / "hopper_flash", dest, ignore=shutil.ignore_patterns("__pycache__"))
    patch = VARIANTS / f"{args.name}.patch"
    r = subprocess.run(["patch", "-p1", "--forward", "-d", str(args.outdir), "-i", str(patch)])
    if r.returncode:
        print(f"{patch.name} did not apply to hopper_flash/ as it is now", file=sys.stderr)
        return r.returncode
    print(f"PYTHONPATH={args.outdir} python -P -m hopper_flash.bench ... runs the {args.name} variant")
    return 0


if __name__ == "__main__":
    sys.exit(main())
