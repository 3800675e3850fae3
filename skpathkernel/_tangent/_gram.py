"""Tangent features and tangent-kernel Gram matrices from the layers' factors.

For a layer with a rule, the per-sample gradient of output ``c`` with respect to a
parameter is ``sum_s delta_cs (outer) a_s`` over the positions ``s`` where it is applied
(see :mod:`._rules`). With one position the Gram block of two samples is
``(a . a') (delta_c . delta'_c')``: the whole Gram is ``(A_X A_Y^T) * (Delta_X Delta_Y^T)``
elementwise, summed over layers, at a cost of ``O(N M sum_l (d_in + C d_out))`` and
without ever forming the Jacobian. With many positions (convolutions, sequences) each term
is contracted by the cheaper exact form, per-sample gradient blocks or position pairs,
under the memory budget (the cost model is in :mod:`._contract`). Parameters handled by
the generic fallback contribute ``J_X J_Y^T`` from their dense per-sample Jacobians.

Every function works in row blocks (and column blocks) sized from ``memory_budget``: the
factors of one block plus the block's intermediates stay under the budget; the factors of
the column blocks are kept between row blocks only when all factors fit in half the
budget, and are recomputed block by block otherwise; a trace over several outputs whose
blocks do not all fit is first split into groups of outputs whose blocks do, and summed
over them (:func:`_output_groups`: a forward pass per group instead of recomputed blocks).
A block whose terms are kept as gradient blocks is captured in chunks of rows, so that
the positions' factors of one chunk, not of the whole block, are alive at once. A
symmetric ``K(X, X)`` computes the panels on and right of its diagonal only and mirrors
them (:func:`_symmetric_block`); on the CPU with torch on one thread, the terms of dense
rows (formed gradient blocks, the fallback's Jacobians) of a trace take one BLAS SYRK
each instead, the upper triangle alone (:func:`_syrk_block`).

Where a call's time goes, measured on the CIFAR CNN (conv32-pool-conv64-pool-Linear10,
ten outputs, N = 1024, one thread, one block of formed rows, chunks of 16 rows; on one
pinned core of a shared machine, so shares, not times;
``benchmarks/results/gram_cifar_profile.md``): the SYRKs about a third, at the
GEMM rate (203 GFLOP, the upper triangle of 193,920-wide rows); forming the gradient
blocks a little over a quarter: 115 GFLOP, one GEMM per sample of ``C p x S`` backprops
by ``S x q`` patches at about 0.85 of the GEMM rate (0.6 for the first convolution's
``27 x 1024 x 320``), plus the first touch of the block's fresh memory, 196,000 page
faults (one per 4 KiB), about 4% of the call and paid by every call, as the block is
freed with it; the captures about 40%: the forward and the ten backward passes. Their
GEMM part (the second convolution's input gradient for every output, 97 GFLOP) runs at
the GEMM rate; their element-wise steps on the first convolution's activations (ReLU and
max-pool backward with its zero fill, the backprops' copies into their buffers, 2 MiB
per chunk, cold in cache) are bound by memory and take about as long again (the
forward's max-pool with indices adds 4%). The first convolution's 896 parameters thus
cost about a third of the call: their per-sample gradients need every output's backprop
through the second convolution. (SciPy's OpenBLAS for the forming GEMMs ran 1.16-1.19x
torch's bmm on the second convolution's shape alone, but 0.99-1.06x on the forming
inside the call, 0.99-1.02x on the call: not kept. Nor one batched backward pass for all
the outputs, ``is_grads_batched``: the ReLU and max-pool backward over ``C n`` rows stream
the bytes of ``C`` passes, and the ``(C, n, ...)`` backprops cost forming a copy; the
call took as long or longer, here and on the ResNet.)

A plain CNN (an ``nn.Sequential`` of ``nn.Conv2d`` blocks, each with ReLUs and at most one
max-pool whose windows do not overlap, then ``nn.Flatten`` and an ``nn.Linear`` head, no
hooks: the CIFAR CNN) is captured on the CPU without the use watch and the autograd graph
(:func:`._capture.plain_cnn_capture`, :mod:`._cnn`; a GPU keeps autograd's passes until a
GPU run times and checks the route): one forward pass by the layers' own functions, then
the backprops by hand, autograd's values bit for bit (the head's rows; the ReLUs' and the
pool's backward at the pooled resolution for all the outputs in one call, written
straight into the buffers, instead of a zero fill, a scatter, a threshold and a copy per
output; the convolutions' input gradients by autograd's ``convolution_backward``, once on
the ``n C`` rows instead of once per output), the terms from the layers' rules as before.
On the CIFAR CNN (N = 1024, one thread, core 1, load 6-8) that alone took 0.860 and 0.912
of the CPU time by medians of 5 alternated rounds in two runs (0.851-0.987 and
0.899-0.927 by round), K bit for bit. Where the first convolution's gradients are formed
and a max-pool follows it, they are formed from its pooled backprops and the patches
gathered at the pool's argmax (:func:`._cnn.first_formed`): a quarter of the products and
no backprop buffer at the convolution's resolution (1.25 MiB per row of the CIFAR CNN's
ten outputs); K is then the general route's values in other sums (7.5e-8 of the largest
entry on the CIFAR CNN), 0.930 of the time without it (0.907-0.981 by round, load 4-6),
the peak of torch's allocations less K 859 MiB against 873. Both, against the general
route: 0.792 of the CPU time by medians of 5 alternated rounds (0.760-0.835 by round;
4.49 s against 5.67, load 5), the peak less K 859 MiB against 856 of the 1 GiB budget
(``benchmarks/results/cnn_route_ab-s47.md``); the quick benchmark's roofline ratio of that
row read 0.50 where the base commit's read 0.41 back to back. What is left is mostly
arithmetic: the second convolution's input gradient for every output (97 GFLOP, about
0.4-0.5 of the GEMM probe's rate in oneDNN's kernel), forming at about 0.6, the SYRKs at
about 0.9.
(Not kept: channels_last for these convolutions. oneDNN's input gradient of the second
convolution ran 1.2-1.3x as fast on channels_last backprops, but forming needs them
position-last, and converting them first left it 0.90-0.93x as fast as the NCHW call,
with the result's conversion back still to pay; its forward 1.26-1.28x on rows already
converted, about 0.015 s of the call. ``benchmarks/bench_cnn_route_kernels.py``.)
Measured again in s48 (``benchmarks/results/cifar_faults_ab-s48.md``, one pinned core
of a machine at load 8-12): a call took 4.9 s of CPU time, 0.7 s of it system time for
370,000-410,000 page faults: 193,000 of the formed block (755 MB, fresh at every call)
and 180,000-220,000 of the captures' temporaries, which glibc's heap handed back to the
kernel and faulted in again chunk after chunk. The plain-CNN route now pools by the
channels-last kernel (:func:`._cnn._max_pool`: the forward 0.27 s against 0.46) and
writes the first convolution's pooled backprops in :func:`._cnn.first_formed`'s layout
(:func:`._cnn._pooled`: no fresh tensor, no copy there): the captures then fault 7,000-
21,000 times, 1.7-1.9 s of CPU time against 2.3-2.4, K bit for bit, the peak of torch's
allocations less K 853 MiB against 867, and 0.906 of the call's CPU time by medians
of 5 alternated rounds in fresh processes (0.819-0.921 by round).
Isolated on a 16-row chunk, with its memory warm, the kernels run near the GEMM probe's
rate: forming's ``640 x 256 x 288`` bmm at 0.95 of it, the second convolution's input
gradient (``convolution_backward``) at 0.82; the call loses mostly to the faults and the
memory-bound steps around them. (Not kept: the later chunks of a formed block captured
inside :func:`.._memory.retained_heap`, which took the captures' faults to 7,000-17,000
but the call 1.016 of the time without it in fresh processes (1.006-1.029 by round),
once the two cuts above were in; the formed block in transparent huge pages,
``madvise(MADV_HUGEPAGE)`` on torch's memory by ctypes: writing a fresh 755 MB tensor
took 0.12 s of CPU time against 0.30 in a loop, but in the call forming took 1.28-1.71 s
against 0.95-0.99, 0.62-0.99 s of it system time for 1,300-1,600 huge-page faults, on
the VM measured; ``MADV_POPULATE_WRITE`` before writing it, 0.30 s against 0.29. The
second convolution's input gradient as one GEMM by the weight then ``F.fold``: 28
GFLOP/s against 141, the GEMM alone 56; as ``F.conv2d`` with the flipped weight 149
against 141, about 0.035 s of the call: not done.) What is left, by the profile: the
SYRKs (1.3-1.4 s), forming with the block's faults (0.95 s, 0.3 s of it system time),
the input gradient and the gates (1.0 s), the first convolution's gather and products
(0.33 s), the forward (0.27 s).
Session s49 (``benchmarks/results/cifar_levers-s49.md``, load 4-5, no engine change):
the same shares (call 4.4-4.6 s: SYRKs 1.42-1.54 s, forming 0.98-1.03 with 0.28-0.30 s
of system time for 193,000 faults, backward 1.10-1.18, first convolution 0.37-0.42,
forward 0.30). Not kept, measured in isolation: (b) the SYRK runs at OpenBLAS's GEMM rate
(a ``1024 x 193920`` block: 1.405 s, 144.7 GFLOP/s of the triangle's, the probe 165.8);
the transposed layout 1.720 s, column slices 1.48-1.61, MKL's full GEMM 2.196 s (185
GFLOP/s executed, twice the FLOPs), MKL's triangle by 256-row strips 1.623, a SYRK of each
diagonal square with MKL's GEMM right of it 1.423 / 1.477 / 1.750 s (512 / 256 / 128
rows), MKL's own ``ssyrk`` (an internal symbol of torch's MKL) 1.354 and, in another run,
1.456 against 1.458: no faster route. (a) The formed block's faults: one output group
allocates it once, and groups sharing one buffer each pay the capture's
output-independent work again (the forward 0.30 s, the first convolution's gather about
0.2 s, or with the second convolution's pooled backprops kept, their zero fill and
scatter, 0.19 s, twice) for at most 0.14 s (two groups) to 0.25 s (ten) of faults saved.
(c) The second pool's backward by one ``torch.where`` of an argmax-and-ReLU mask: 11-29
ms a 23-row chunk against the zero fill, threshold and scatter's 3.3-4.1 (ATen's CPU
``where`` is not vectorised); by a product with a float mask 1.85-1.89 ms plus the mask's
1.46-1.64 (and an infinite gradient would turn NaN). (d) The first convolution's forming:
its rows from the padded input in one copy 1.5-1.6 ms against about 0.6 for the two, the
gather into a reused buffer no faster, the transposed bmm 3.7-4.1 ms against 2.0-2.6; its
forward as a GEMM of the same patches would change the forward's bits (the pools' argmax
with them). Nor the second convolution's backprops channels-last: its input gradient
took 13.5-13.7 ms a chunk against 17.2-17.3 alone, but in the call (a prototype by
patching) 1.096 of the route's CPU time by medians of 3 alternated rounds (1.061-1.105 by
round, K to 7.45e-8 of its largest entry): the input gradient 0.689 s against 0.887,
forming by one GEMM per sample and output with the copies into the block 1.46 s against
1.05, the scatter into that layout and the first ReLU's reading of it 0.31 s against 0.17.

On the ResNet (ten outputs in five groups of two, N = 1024, one thread, one block of all
rows per group in chunks of 36; ``benchmarks/results/gram_resnet_profile.md``, shares
on a shared machine): the backward passes about 31% (ten per chunk, with the copies of
their gradients into the chunk's buffers), the SYRKs 26-29% (at the GEMM rate: about half
the roofline bound's time alone), the forward passes 14% (one per chunk and output group),
the rest of the captures (the use watch, the factors of the layers not formed in the
capture) 10%, forming 16%; page faults about 2.5%. Most of the call is thus the captures,
which the bound does not count; their input-gradient convolutions run at 20-90 GFLOP/s
(oneDNN's stride-2 ones the slowest). The chunks hand the rule layers' outputs on
uncopied (``capture``'s ``copy_sites``): the call 1.08-1.09x as fast by medians, K bit
for bit. (Not kept: the output groups sharing the chunks' backprop buffers, no fewer
page faults; chunks twice as wide, 1.03x, within the noise, at 1.4x the peak memory.)

Where the forward passes' graphs of all the rows fit beside a group's blocks, the output
groups of a symmetric trace share one forward pass per chunk, its graph kept from the
first group's capture to the last's (:func:`_kept_forward_groups`; ``capture``'s
``kept``), in the fewest groups that fit what the graphs leave of the budget. The graph's
bytes per row are counted on the probe's capture (the tensors its forward pass saves,
the sites' outputs and the layers' inputs: 687 KB per row on the ViT row, 1.33 MB on the
ResNet's, where they do not fit at N = 1024 and the default budget). On the ViT (N =
1024, one thread, default budget): ten groups of one output instead of four of two and
three, one forward pass instead of four, and with one output per capture no copy of the
backprops into a buffer and no copy of a linear layer's delta in forming: 0.873 of the
CPU time by medians of 3 alternated rounds (0.783-0.883 by round, 12.88 s against 14.75
s, load 4-5), K to 5.6e-7 of its largest entry (the groups' sums in another order), the
peak of torch's allocations less K 927 MiB against 1141
(``benchmarks/results/vit_cuts_ab-s46.md``). Its phases: forward 0.51 s against 1.39,
the captures' rest 1.56 s against 0.91 (the factors that depend only on the forward,
LayerNorm's x-hat and the patches, are computed once per group: ten times instead of
four; kept for all the rows, the ViT's x-hats alone would add 83 KB per row to the
graphs, which then no longer fit). The chunks are sized by their estimate
(:func:`_chunk_row_bytes`) less the graph's bytes, which the kept graphs count: 28 rows
instead of 22 on the ViT, 0.966 of the time (0.947-0.997 by round), K bit for bit, peak
932 MiB against 927; 44-row chunks measured 0.954 at 947 MiB. (Not kept: the
backprops of linear sites laid out outputs-inner, ``(n, S, C, p)`` in memory, so that
forming's ``C p x S`` operand is a transposed view instead of a copy: K bit for bit,
forming 0.47 s faster but the strided copies into the buffers as much slower, 0.992
(0.939-0.997) of the time without kept forward passes, 0.995 (0.995-1.017) with them,
whose one-output groups copy nothing.)

The probe counts the graph's bytes on a capture that hands the sites' outputs on
uncopied, as the chunks do (:func:`_prepare`; copied there as in the chunks where a site
is rewritten in place). Counted with copied sites (every site's output and its copy),
they read 715,672 bytes per row on the ViT row once a custom Function's ``ctx`` tensors
were counted too (session s47): 13% above the 632,432 that a kept forward pass of the
chunks holds (the profiler's count of such a pass equals the new estimate to the byte),
and the row had lost the kept plan, back to four groups of two and three outputs with a
forward pass each and 27- and 125-row chunks. Restored (ten one-output groups, 64-row
chunks): 0.814 of the CPU time by medians of 3 alternated rounds (0.778-0.897 by round,
12.22 s against 15.01, load 7-10), K to 5.6e-7 of its largest entry, the peak of torch's
allocations less K 978 MiB against 1142 (the plan of four groups held more than the
1 GiB budget) (``benchmarks/results/vit_cuts_ab-s48.md``). Phases after it (one call,
core 0, load 9): products 5.2 s, backward 3.5 s (the CPU flash attention's backward
1.50 s of it, 320 calls on 64 rows x 4 heads x 65 tokens; GELU's 0.27 s, LayerNorm's
0.21 s), the captures' rest 1.3 s (LayerNorm's x-hat recomputed per group 0.36 s, the
sums of the biases' and LayerNorms' backprops over the 65 tokens 0.4 s), forming 1.2 s,
the forward passes 0.36 s. (Not kept: the attention's backward by ``bmm``, P recomputed
from the saved log-sum-exp: 4.75 ms a call against flash's 4.67-4.97 on those shapes;
torch's math attention saves P, 135 KB more per row of the two layers' graphs, which
would then not fit beside one output's blocks.) The attention's packed in-projection is
split into q, k and v by ``unbind`` of its output's rows (:func:`._layers._packed_heads`):
the backward pass stacks their gradients into the projection's rows in one copy, where the
chunks of its sequence-first transpose cost a ``cat`` and a copy back (0.43 s above):
0.967 of the CPU time by medians of 3 alternated rounds (0.951-0.971 by round, load
9-12), but 0.994 (0.989-1.001) in a second run at load 3-4, within its rounds' spread:
kept as no slower, its gain the copies' memory traffic where the cores' neighbours
contend for it; K bit for bit, the same peak (``vit_cuts_ab-s48.md``).

A convolution whose patches outnumber its block's entries (more positions than outputs x
channels: the ResNet's 32 x 32 and 16 x 16 ones in its groups of two outputs) has its
blocks formed by the capture, by one grouped convolution backward on the chunk, without
copying its patches (:func:`._layers._conv_formed`): the ResNet's call took 0.94-0.95
of its CPU time by medians, 0.90-0.93 by least (``benchmarks/results/conv_formed_ab.md``).

The captures take each output's backprops by hooks on the sites' outputs as the backward
pass computes them (:func:`._capture._hooked_backprops`), copied into the chunk's buffers
while in cache instead of after the pass; an eval BatchNorm's site, whose terms are its
backprop summed over the positions, gets no buffer: a hook sums each backprop as it
comes, by one ``native_batch_norm_backward`` over the samples' channels
(:class:`._layers._ChannelSums`: no x-hat recomputed, no product in memory); and a
convolution without padding takes its patches from its input rather than from F.pad's
copy of it (the 1x1 shortcuts). On the ResNet row (N = 1024, one thread, default budget,
on a shared machine at load 4-7): 0.889 of the CPU time by medians of 5 alternated
rounds (0.868-0.985 by round, 0.926 by the rounds' median ratio; the BatchNorm cut
alone 0.902); a review's rerun at load 2.7-2.9 read 0.931 (0.920-0.957 by round,
``benchmarks/results/review-resnet-cuts-s47.md``); K to 1.1e-7 of its
largest entry (BatchNorm's sums in another order), the peak of torch's allocations less
K 736.6 MiB against 759.9; the quick benchmark's roofline ratio of the row read 0.49 and
0.47 against 0.43 and 0.46 before, in two rounds of the same session
(``benchmarks/results/resnet_cuts_ab-s47.md``). The copies by hooks alone: 0.987 at
N = 512, K bit for bit. Not done: keeping the forward passes' graphs for the output
groups (:func:`_kept_forward_groups`) on this row. The probe counts 1.34 MB per row with
its copied sites, 1.00 MB with the chunks' uncopied ones (a third of it the BatchNorms'
outputs, held as sites for their backprops, which nothing else keeps): a graph of all
1024 rows does not fit 1 GiB beside even one output's blocks (310 KB per row).
Session s48 (the same row, base 50a894e, load 6-12): the backward passes are its largest
phase, 7.5 s of 21.1 (36%, 0.20 of the GEMM probe's rate). Not kept: the captures' 1x1
convolutions (the two stride-2 shortcuts) as an ``autograd.Function`` whose backward is
``W^T`` times the backprop, one matmul per sample written into the strided positions of a
zero input gradient, instead of oneDNN's NCHW backward by data: 0.16-0.34 of its time
alone, 0.961-0.997 of a capture's by round, but the call 1.020 by medians of 5 alternated
rounds (0.972-1.064 by round), K bit for bit; about 2% of the call by the captures' count,
which that load does not resolve. Nor, in alternated kernel timings: the 3x3 stride-2
input gradients through channels-last copies (1.0x in one process, 2.5x in another), by
a polyphase split (0.79x and 1.96x the time), im2col's matmul and ``F.fold`` (1.4x);
forming in capture per output as each backprop comes, without the copy into the chunk's
buffer (0.95-1.12x). The graph of the kept forward passes is 0.996 MB per row with
uncopied sites: 1.02 GB at N = 1024, over the budget alone
(``benchmarks/results/resnet_backward_ab-s48.md``).
Session s49: the Gram's captures fold each eval BatchNorm called on a rule convolution's
output, and on nothing else, into that convolution (``capture``'s ``fold_bn``,
:meth:`._capture._UseWatch._fold`, :func:`._layers.fold_batch_norm`): the BatchNorm's
output, its values bit for bit, comes from a Function whose backward is the
convolution's input gradient by the scaled weight (no BatchNorm backward); the
convolution's output is not held, nor the BatchNorm's, whose site is its gradient edge
(:class:`._capture._EdgeSite`); the per-sample gradients come from its backprop
(:func:`._layers.folded_terms`: the weight's formed in the capture, then scaled per
channel; BatchNorm's weight from ``<W, G>``, no division by gamma). The probe's graph fell
from 995,624 to 308,168 bytes per row (652,232 with the sites' outputs held: 2.4% short
of the kept plan by its estimates), 316 MB at N = 1024: the row takes the kept plan, ten
one-output groups sharing one forward pass per 44-row chunk (24 forward passes instead of
145). The call: 0.909, 0.951 and 0.865 of the CPU time by medians of 5 alternated rounds
in three runs (0.836-1.008 by round, load 2-4), K to 3.4e-7 of its largest entry, the peak of
torch's allocations less K 676.5 MiB against 736.6
(``benchmarks/results/resnet_fold_ab-s49.md``). Its phases then (one core, load 4): the
forward passes 0.55 s (2.9 s before), the backward passes 5.4 s (7.5), forming in the
capture 6.5 s (2.3 s, with forming 0.7 s against 1.6: one output per capture, every weight
formed there), the products 5.8 s, of 19.5 s. Not kept: the weights that
:func:`._layers._conv_formed` declines (the stem, the shortcuts, the 8 x 8 convolutions)
left to the engine's forming from their factors, the backprop scaled in place and
BatchNorm's sums from the convolution's output recomputed: 1.033 of the time of forming
them in the capture by medians of 4 alternated rounds (1.024-1.096 by round).
Session s50 (``benchmarks/results/resnet_groups_ab-s50.md``, load 2-10): the phases of
the kept plan (21.6 s, GEMM probe 156 GFLOP/s): forming in the capture 7.6 s (the
formed blocks' 256 GFLOP at 0.20 of the probe's rate; the 8 x 8 convolutions from their
patches the most, 1.9 s for ``blocks.2.conv2``), the backward passes 6.1 s (247 GFLOP
at 0.26), the SYRKs 5.8 s (0.89). Not kept: the two-output groups of the kept plan,
which a chunk estimate counting the folded convolutions' patches once (instead of four
times each) lets in: five groups of two in 26-row chunks instead of ten of one in 44,
1.036 of the CPU time by medians of 3 alternated rounds (1.010-1.090 by round), the
peak of torch's allocations less K 989.7 MiB against 676.5; and that estimate held up
to 1.31x small budgets on a test-sized ResNet, its four-times term having also paid for
the forward graph. Nor the folded convolutions' input gradients by the transposed
convolution instead of ``convolution_backward`` given the input's shape as an expanded
tensor (the same bits; 1.1-2.3x as fast alone on 44-row chunks, 0.84 of their time in
the call by medians of 3 alternated rounds, 4.4 s against 5.3): the call 1.005 by
medians of 5 alternated rounds (0.983-1.008 by round), no gain seen. With the present
kernels (oneDNN's 16-64-channel convolutions at 30-60 GFLOP/s here) the row's roofline
ratio is bounded near 0.55-0.6 (the results file's estimate): 0.8 needs forming and the
backward passes, 503 GFLOP, at about 85 GFLOP/s, twice their rates now.

A symmetric trace ``K(X, X)`` of a plain MLP with one output (an ``nn.Sequential`` of
``nn.Linear`` and elementwise activations without hooks, :func:`._stacked.stacked_mlp`;
a one-target regressor's default network) whose factors fit one block skips the capture
(:func:`_plain_mlp_gram`): the factors come from one forward and one backward pass by the
same aten operations as autograd's (:func:`._stacked.gram_factors`, the same bits), and
the panels above are the general route's, so K is the same bit for bit. Left out: the
probe capture and one-sample autograd check of :func:`_prepare` (2.1-3.1 ms of a 33-35 ms
warm call on 64-512-512-1 tanh at N = 1024), the use watch, the autograd graph, and the
fresh memory of the call's dozen tensors: all its buffers but K share one arena
(:class:`._stacked.Arena`), the panels' products, the folded head and the float32 panel
of a float64 K included, which the C library's heap hands to the next call again. The
public call took 0.91x the CPU time back to back, 0.84x on a cold heap, 0.37-0.54x at
N = 128, and the quick benchmark's roofline ratio of that row read 0.78-0.81 where it
read 0.37 on the same VM before (``benchmarks/results/gram-mlp-s46.md``,
``gram-quick-roof-s46.md``). Not kept: the arena and K on 2 MiB boundaries in NumPy's
memory (huge pages: on a cold heap 50 page faults per call instead of 2,400, but in the
quick benchmark's protocol the medians of its timed calls were 41-48 ms against 34-37
with torch's memory, the system time of fresh huge pages on the VM measured); the path
kernel's stacked route (:func:`._stacked.stacked_path_sum`) with one point, 1.1x this
route's time on that network; panels of 512 / 64, 512 / 96, 256 / 128 or 1024 / 128
rows (1.04-1.08x the time of 512 / 128). The transposed copy of a whole float32 square
into a float64 one is 10x slower than by column strips (6.9 against 0.6 ms at
N = 1024): the mirror stays by panels.
Session s50 (the same row, issue 31; ``benchmarks/results/plain_mlp_ab-s50.md``,
``plain_mlp_notes-s50.md``): the s50 reading of 0.73 was no regression (the public call
at a0582b1, s47's 0.80, against b9f9409 alternated in one process: 43.6 and 42.9 ms,
K bit for bit). Where the call went (one pinned core, load 6-7, CPU time): the factors
10.5 ms (their three GEMMs 8 at the probe's rate; tanh, its backward and the head's row
copied 1.7), the panels 27.8 (their GEMMs alone 20.3-20.7, at the probe's rate 17.5; the
Hadamard products and the bias's ones 1.3; the diagonal squares' symmetrising, the
float64 widening and the mirror 3.2; the generic route's Python per panel, its terms'
row views rebuilt as dataclasses and their checks, 2.4), the folded head's rows
``[g a, g]`` 0.74, the first-sample forward check 0.6, the public call's finiteness sum
of the float64 K 0.9 and its other steps 0.6. Kept, K bit for bit as before and as the
general route's: the panels by a loop over the terms' matrices (:func:`_plain_panels`:
the same operations in the same order), the head's input written by the last hidden
Linear straight into the folded rows ``[a, 1]`` (``g`` is 1: :func:`_head_in_fold`,
where one activation in place follows and the width is a multiple of 64, the strided
rows' kernels then the same bits), the first backward kernel reading the head's row
broadcast instead of a copy of it, the diagonal squares symmetrised by one product into
them: 0.934 of the public call's CPU time and 0.941 of the engine's by medians of 15
alternated rounds at load 8 (37.8 against 40.5 ms), 0.955 / 0.948 at N = 2048 on
64-512-512-512-1, the peak of torch's allocations 6.1 MiB against 8.1 (the last hidden
output's buffer is the folded rows). Not kept (bits changed, no gain beyond the load's
noise; prototypes on the call's factors, alternated, load 6-7): the bias's ones as a
column of the inputs (``[a, 1]`` in every rank-one term, no ``Ga += 1``) 0.98 of the
panels' time, ``addcmul_`` for the second term's product and sum 0.987; the panels
computed into a float32 square and widened once at the end, mirrored per panel, at the
end by strips, or by NumPy: 1.03-1.05 (the float64 K's 8 MB written once either way);
the mirror through torch's blocked transpose into a contiguous buffer, 0.44 ms against
0.445 per 512 x 512 panel alone. What is left: the GEMMs (about 0.86 of the probe's rate
in the panels, whose 128-row inner ones pack 2.5x the operand bytes per FLOP of the
512-row one, by the count ``(m + n) k / 2 m n k``; about the rate in the factors), the
float64 K's writes and finiteness sum, tanh and its backward, and under 1 ms of Python in
the panels (the loop 0.8 ms above a bare script of the same operations).

Session s53 (``benchmarks/results/gram_dense_route-s53.md``): a user trial found
``output="full"`` on a small DDPM U-Net (C = 64 outputs, the whole 8 x 8 image, P = 4033,
N = 32) at 1.8x the time of a user's ``vmap(jacrev)`` J J^T. The engine already takes the
dense route there: every term but the embedding and a 2 x 2 convolution is formed into
per-sample gradient blocks (the cost model of :func:`._contract.gram_route`), so the
pairwise contraction of factors was not the waste. The "full" products of formed blocks
were: each term's ``C x C`` blocks by a GEMM into a fresh ``(n C, n C)`` tensor (16 MB at
N = 32, its pages faulted in every time), added to the block, and the diagonal block's
squares symmetrised through a permuted copy of the whole block, twelve times per call.
Kept (:data:`FULL_SYRK`): the symmetric block of a "full" Gram is the square of the
``(n C, r)`` rows of sample and output, so the formed terms take one SYRK each on it, as a
trace's do (:func:`_syrk_block`), the other terms by panels of samples and the exact mirror;
the blocks off the diagonal (and ``K(X, Y)``) one GEMM per formed term straight into the
block's ``(n C, m C)`` square (:func:`_square`). U-Net full, by medians of 5 alternated
rounds in two runs (one pinned core, load 7-10): 0.707 and 0.739 of the CPU time at
N = 32 (0.621-0.857 by round), 0.454 and 0.440 at N = 64 (0.373-0.497), K to 1.6e-7 of
its largest entry, the peak of torch's allocations less K 42.6 MiB against 47.8 and 51.9
against 126.2; "full" on the benchmark's networks 0.789 (CIFAR CNN, N = 128), 0.840
(ResNet, N = 64), 0.851 (ViT, N = 64), the same peaks; the trace Grams take the same
operations as before, bit for bit. The trial's own row then read
0.484 s against torch.func's 0.353 (0.589 before, in the same process). Not kept:
the formed terms of a "full" block concatenated into one SYRK (a 2048 x 4033 square of
the U-Net at N = 32, 0.109-0.124 s against 0.110-0.123 for the twelve SYRKs of 1-2304
columns: the small terms' triangles take 8 ms together). Kept too (:data:`BATCHED_CHECK`):
the one-sample autograd check (:func:`._capture._numerical_misfits`, one backward pass per
output on two rows, mostly the cost per operation there) as one batched backward pass over
the outputs wherever its gradients and intermediates fit an eighth of the budget, on the
CPU too: the check alone 0.61 of its CPU time on the U-Net (0.048 s against 0.079), 0.69-
0.80 on the ViT, ResNet and 8 x 8 CNN, 1.01-1.06 on the transformer and the CIFAR CNN
(a few ms); the U-Net's calls 0.926 (trace, N = 64) and 0.910 (full, N = 32) of the CPU
time by medians of 5 alternated rounds, K bit for bit. What is left there: the probe
capture's 64 backward passes on its two rows, the chunks' 64 per chunk, the SYRKs at the
GEMM rate.

Session s55 (``benchmarks/results/small_gram-s55.md``): a call on a few rows is mostly
fixed costs, each a forward pass and a backward pass per output whatever the rows: the
output count's forward, the probe capture of the check's rows, the autograd check, and
the Gram's own capture. A symmetric Gram of at most :data:`OWN_CHECK_ROWS` rows has its
probe capture and check run on ``x0, ..., x_{n-1}, x0`` (:func:`_own_check_rows`), and its
block is the first ``n`` rows of that capture (:class:`_Blocks`' ``given``): one capture
fewer, and the check sees the very batch the Gram is computed from; unchecked (a path
kernel's steps) its probe capture is of X's rows; any call whose checked rows begin with
``X`` (one query against a training set) reuses them alike. More rows than the check's
four are captured before the block plan only where a capture of ``x0`` says they fit
the budget (:func:`_unplanned_fits`, one capture more; the review of session s55): the
gains below at N = 4-16 are then mostly gone (about even with before). A capture whose
outputs' site gradients are small takes them by one batched backward pass
(:func:`._capture._small_pass`) instead of one per output. K the same bits as before on
the benchmark's MLP, CNN and U-Net (6e-8 of the largest entry on the MLP's one row); the
public call 1.0-2.6x as fast (a path kernel's of 8 steps 1.15-2.75x on the CNN and the
U-Net), still behind torch.func's ``vmap(jacrev)`` on the CNN at N <= 64, the U-Net at
N <= 32 and the MLP at N = 1, where the check's backward pass over the outputs (with
every parameter's gradient) is now the largest cost.

``X`` is what the module takes, ``(n_samples, ...)``: float features, images, sequences,
or integer token ids; kernels and features have the parameters' dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import torch

from .._memory import large_tensor, rows_per_block
from .._modules import module_lock
from ._capture import (
    CHECK_SAMPLES,
    Capture,
    _checked,
    _copies_fit,
    _picks,
    capture,
    check_per_sample,
    checked_capture,
    forward,
    plain_cnn_capture,
    value_dtype,
)
from ._cnn import plain_cnn
from ._contract import (
    dense_grad,
    dense_rows,
    densify,
    gram_route,
    index_scaled,
    pair_bytes,
    pair_diag,
    pair_diag_bytes,
    pair_gram,
    param_numel,
    rank_one,
)
from ._layers import formed_workspace
from ._rules import Term
from ._stacked import (
    _IN_PLACE,
    Arena,
    _blas_eligible,
    _blas_threads,
    _holds_blas,
    _mirror,
    _syrk,
    gram_factor_sizes,
    gram_factors,
    stacked_mlp,
)

__all__ = ["contracted_features", "hidden_reads", "tangent_features", "tangent_gram",
           "tangent_gram_diag"]

DEFAULT_MEMORY_BUDGET = 2**30
#: Fewest rows per capture of a block of formed gradients, where a quarter of the memory
#: budget holds them.
MIN_CHUNK = 16
#: Fewest rows of a symmetric block whose dense rows take a SYRK (:func:`_syrk_block`);
#: smaller blocks keep torch's products, as the stacked path's small panels do.
SYRK_MIN_ROWS = 128
#: Rows of the panels by which the terms other than a SYRK's are added (:func:`_add_upper`).
ADD_ROWS = 256
#: Whether a symmetric "full" block of dense rows takes the SYRK of its ``(n C, n C)``
#: square and the other blocks one GEMM into theirs (session s53; the A/B's switch).
FULL_SYRK = True
#: Whether the autograd check of a few samples is one batched backward pass over the outputs
#: where it fits an eighth of the budget (session s53; the A/B's switch).
BATCHED_CHECK = True



def _resolve_output(output, n_outputs: int) -> tuple[list[int], str]:
    """Outputs to differentiate and the contraction mode ("trace" or "full")."""
    if isinstance(output, str):
        if output == "trace":
            return list(range(n_outputs)), "trace"
        if output == "full":
            return list(range(n_outputs)), "full"
        raise ValueError(f"output must be 'trace', 'full' or an int, got {output!r}.")
    if isinstance(output, bool) or not isinstance(output, int):
        raise TypeError(f"output must be 'trace', 'full' or an int, got {output!r}.")
    if not -n_outputs <= output < n_outputs:
        raise ValueError(f"output={output} is out of range for {n_outputs} network outputs.")
    # One output is the trace over a single output: no division, one backward pass.
    return [output % n_outputs], "trace"


def _layout(params: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Start and size of every parameter in the flat (trajectory) order."""
    layout, start = {}, 0
    for name, p in params.items():
        layout[name] = (start, p.numel())
        start += p.numel()
    return layout


def _contract(U: torch.Tensor, V: torch.Tensor, mode: str, out=None) -> torch.Tensor:
    """``U (n, C, r)`` against ``V (m, C, r)``: (n, m) trace / C or (n, C, m, C) blocks;
    a trace into ``out`` where given."""
    n, C, r = U.shape
    m = V.shape[0]
    if mode == "full":
        return (U.reshape(n * C, r) @ V.reshape(m * C, r).T).reshape(n, C, m, C)
    if out is not None:
        G = torch.matmul(U.reshape(n, C * r), V.reshape(m, C * r).T, out=out)
        return G.div_(C) if C > 1 else G
    G = U.reshape(n, C * r) @ V.reshape(m, C * r).T
    return G / C if C > 1 else G


def _accumulate(out: torch.Tensor, tx: Term, ty: Term, mode: str, weight, layout,
                first: bool = False, scratch=None) -> None:
    """Add one term's Gram block ``J_term(x) D J_term(y)^T`` to ``out`` in place;
    ``first``: write it instead (``out`` holds anything). ``scratch``: an
    :class:`._stacked.Arena` with regions "gd" and "ga" where a trace's rank-one products
    are written (else fresh tensors)."""
    if first and not (weight is None and rank_one(tx)):
        out.zero_()
        first = False
    if weight is None:
        if not rank_one(tx):
            out.add_(pair_gram(tx, ty, mode))
            return
        dx, dy = tx.delta[:, :, 0], ty.delta[:, :, 0]
        full = mode == "full"
        # Dense rows (gradient blocks, the fallback's Jacobians): one GEMM into out, for
        # "full" into the (n C, m C) square of its C x C blocks, no product in a fresh
        # tensor added after (session s53).
        square = (out if not full else _square(out) if FULL_SYRK else None) if all(
            a is None for _, a in tx.inputs) else None
        if square is not None:
            n, C, r = dx.shape
            rows, width = (n * C, r) if full else (n, C * r)
            square.addmm_(dx.reshape(rows, width), dy.reshape(-1, width).T,
                          beta=0 if first else 1, alpha=len(tx.inputs) / (1 if full else C))
            return
        # sum over the term's parameters of (a . a') times the shared (delta . delta').
        reuse = scratch is not None and mode != "full"
        shape = (dx.shape[0], dy.shape[0])
        Gd = _contract(dx, dy, mode, scratch.get("gd", shape) if reuse else None)
        Ga, ones = None, 0
        for (_, ax), (_, ay) in zip(tx.inputs, ty.inputs):
            if ax is None:
                ones += 1
            elif Ga is None:
                Ga = (torch.matmul(ax[:, 0], ay[:, 0].T, out=scratch.get("ga", shape))
                      if reuse else ax[:, 0] @ ay[:, 0].T)
            else:
                Ga.addmm_(ax[:, 0], ay[:, 0].T)
        if Ga is None:
            if first:
                torch.mul(Gd, ones, out=out)
            else:
                out.add_(Gd, alpha=ones)
            return
        if ones:
            Ga += ones
        if mode == "full":
            Ga = Ga[:, None, :, None]
        # Not addcmul_: its fused multiply-add rounds differently in the vector body and
        # the tail of a row, so an entry's bits would depend on where a block splits.
        if first:
            torch.mul(Gd, Ga, out=out)
        else:
            out.add_(Gd.mul_(Ga))
        return
    if tx.rows is not None:
        # An index term pairs positions of the same id: D scales one side's rows.
        start, size = layout[tx.inputs[0][0]]
        out.add_(pair_gram(index_scaled(tx, weight.values[start : start + size]), ty, mode))
        return
    # A diagonal D breaks the rank-one structure: (delta (x) a) D (delta' (x) a')^T has no
    # factorised form, so each parameter's per-sample gradients are materialised for the
    # block (n x p*q per side, sized into the budget) and multiplied by one GEMM. Terms
    # with several positions arrive here already as gradient blocks (constant inputs).
    for (name, ax), (_, ay) in zip(tx.inputs, ty.inputs):
        start, size = layout[name]
        w = weight.values[start : start + size]
        n, C = tx.delta.shape[:2]
        # Into the call's scratch (a fresh tensor of this size faults in every page), and
        # never into the capture's own tensors (a bias's "kron" is its delta itself).
        gx = weight.scratch(0, (n, C, size), tx.delta)
        torch.mul(dense_grad(tx, None), w, out=gx) if ax is None else \
            dense_grad(tx, ax, out=gx).mul_(w)
        gy = dense_grad(ty, ay) if ay is None else \
            dense_grad(ty, ay, out=weight.scratch(1, (ty.delta.shape[0], C, size), ty.delta))
        out.add_(_contract(gx, gy, mode))


def _square(out: torch.Tensor) -> torch.Tensor | None:
    """An ``(n, C, m, C)`` block as the ``(n C, m C)`` matrix of its rows (a view), or
    None where its strides do not allow one (a view of ``blocks_last``'s layout)."""
    n, C, m, _ = out.shape
    s = out.stride()
    if s[0] != C * s[1] or s[2] != C * s[3] or s[3] != 1:
        return None
    return out.view(n * C, m * C)


class _Scratch:
    """One buffer, grown on demand and reused as any shape that fits.

    Reusing it keeps its pages faulted in across the panels and terms of one Gram.
    """

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        if self._buffer is None or self._buffer.numel() < numel:
            # Its contents are not kept: the smaller buffer goes before the larger one
            # is taken (output groups of unequal widths, each block in one, would
            # otherwise hold the narrower group's blocks beside the wider one's).
            self._buffer = None
            self._buffer = like.new_empty(numel)
        return self._buffer[:numel].view(shape)


class _Weighted:
    """A diagonal preconditioner and two scratch buffers for the blocks it scales.

    The per-sample gradients of one parameter are formed for a panel of rows and one of
    columns at every product, each side in its own :class:`_Scratch`.
    """

    def __init__(self, values: torch.Tensor):
        self.values = values
        self._buffers = (_Scratch(), _Scratch())

    def scratch(self, side: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return self._buffers[side].get(shape, like)


def _rows(terms: list[Term], rows: slice) -> list[Term]:
    """The terms restricted to a slice of their samples (views, no copy)."""
    return [dataclasses.replace(t, delta=t.delta[rows],
                                inputs=[(name, None if a is None else a[rows])
                                        for name, a in t.inputs]) for t in terms]


def _gram_into(out: torch.Tensor, tx: list[Term], ty: list[Term], mode: str, weight,
               layout, scratch=None) -> None:
    """``out = sum over the terms of their Gram blocks``, ``(n, m)`` or ``(n, C, m, C)``.

    ``out`` may be a view into the whole Gram: the block is written in place.
    ``scratch``: see :func:`_accumulate`.
    """
    if not tx:
        out.zero_()
    # The first term writes the block: no pass to zero it, none to add to the zeros.
    for i, (a, b) in enumerate(zip(tx, ty)):
        _accumulate(out, a, b, mode, weight, layout, first=i == 0, scratch=scratch)


def _folded(terms: list[Term], weight, scratch=None) -> list[Term]:
    """The terms, those of one backprop column (a scalar output's head) as dense rows.

    With ``delta`` one number ``g`` per sample, ``(A A^T + ones) * (g g^T)`` is ``F F^T``
    with ``F = [g a, g]``: one product (``q + 1`` wide) added to the Gram, instead of
    two (one of them an outer product, at a fraction of the GEMM rate) and three passes
    over the block (the bias's ones, the Hadamard product, the sum). Not with a
    preconditioner, which scales the parameters' entries apart. ``F`` is written into
    ``scratch``'s region ("fold", i) for the i-th term where it has one.
    """
    if weight is not None:
        return terms
    out = []
    for i, t in enumerate(terms):
        n, C, _, p = t.delta.shape
        factored = [a[:, 0] for _, a in t.inputs if a is not None]
        if not (rank_one(t) and factored and C * p == 1):
            out.append(t)
            continue
        q = sum(a.shape[1] for a in factored)
        shape = (n, q + len(t.inputs) - len(factored))
        F = (scratch.get(("fold", i), shape) if scratch is not None and ("fold", i) in scratch
             else t.delta.new_empty(shape))
        g = t.delta.reshape(n, 1)
        s = 0
        for a in factored:
            torch.mul(a, g, out=F[:, s : s + a.shape[1]])
            s += a.shape[1]
        F[:, s:] = g
        # One constant input: the shortcut of dense rows adds F F^T once.
        out.append(Term(delta=F[:, None, None, :], inputs=[(t.inputs[0][0], None)]))
    return out


def _panel_rows(device: torch.device, width: int = 0) -> tuple[int, int]:
    """Rows of the outer and inner panels of a symmetric block.

    A symmetric block is computed one outer panel of rows at a time, from the diagonal
    to the right, so about half of the factor products are skipped: the part right of the
    panel's diagonal square in one product per factor, the square itself by inner panels
    (their own squares are computed in full and symmetrised). On a CPU, 512 / 128 measured
    fastest on 64-512x3-1 at N = 1024 and 2048 (about 0.53 of the full GEMM FLOPs; 5%
    faster than 128-row panels alone, 1024 / 128 no better). Rows of formed gradient
    blocks (``width``, the widest row, of 2^14 numbers or more: a convolution's C p q)
    make each product stream a long row: 1024 / 256 measured 20% faster there (N = 1024,
    184320 per row). A GPU wants large GEMMs: 2048 / 2048, so only large blocks are split.
    """
    if device.type != "cpu":
        return 2048, 2048
    return (1024, 256) if width >= 2**14 else (512, 128)


def _symmetric_block(terms: list[Term], mode: str, weight, layout, out: torch.Tensor,
                     panels: _Panels | None = None, spare: int = 0) -> None:
    """Write ``K(X_b, X_b)`` of one row block into ``out``, from its upper panels.

    Every computed block right of the diagonal is written twice (mirrored); the squares on
    the diagonal of the inner panels are symmetrised exactly (a GEMM ``A A^T`` is not
    bitwise symmetric). ``panels``: compute each panel there, in the computation's dtype,
    when ``out`` has another one (see :class:`_Panels`). The terms of dense rows take a
    SYRK instead where SciPy's BLAS can run it (:func:`_syrk_block`; ``spare``: the bytes
    its buffers may take).
    """
    if _syrk_block(terms, mode, weight, layout, out, spare):
        return
    _symmetric_panels(terms, mode, weight, layout, out, panels)


def _dense_rows(term: Term, weight) -> bool:
    """Whether a trace's term is one GEMM of its ``(n, C r)`` rows (formed blocks, the
    fallback's Jacobians: :func:`_accumulate`'s shortcut)."""
    return weight is None and rank_one(term) and all(a is None for _, a in term.inputs)


def _syrk_block(terms: list[Term], mode: str, weight, layout, out: torch.Tensor,
                spare: int = 0) -> bool:
    """``K(X_b, X_b)`` with a BLAS SYRK for every term of dense rows; False (nothing
    written) where none or no SYRK applies.

    The panels of :func:`_symmetric_panels` compute the squares on the diagonal of their
    inner panels in full: 0.625 of the full products at 1024 / 256 rows. A SYRK computes
    the upper triangle alone (0.5) at about a GEMM's rate. The SYRKs sum from zero; the
    other terms (rank-one, position pairs) are then added by panels of rows on and right
    of the diagonal, and the upper triangle is mirrored (exactly symmetric). (Summed the
    other way round, each of a SYRK's hundreds of updates of a long row is rounded at the
    scale of the whole entry: 6x the float32 error against float64 on the CIFAR CNN.)

    Only where its buffers (:func:`_syrk_bytes`: a square of the terms' dtype and the
    other terms' panel) fit ``spare``, whatever ``out``'s dtype: a float64 ``out`` of a
    float32 network then takes the same route as a float32 one, and is that Gram
    converted bit for bit. The SYRKs write into ``out`` itself where it is a contiguous
    square of the terms' dtype (the same bits as the square copied), else into the square,
    written once into ``out``. Only on the CPU with torch on one thread, SciPy's BLAS an
    OpenBLAS whose thread limit is process-wide (:func:`._stacked._syrk`). For "full" the
    ``(n, C, n, C)`` block is the square of the ``(n C, r)`` rows of sample and output
    (:data:`FULL_SYRK`), summed with weight 1 instead of ``1 / C``; the other terms are
    added by panels of samples (:func:`_add_upper`), and the mirror makes each ``C x C``
    block ``K(x, x)`` exactly symmetric too.
    """
    like = terms[0].delta
    n, C = like.shape[:2]
    full = mode == "full"
    # "full": the (n, C, n, C) block is the square of the (n C, r) rows of sample and
    # output (see the module docs, session s53).
    rows = n * C if full else n
    dense = [t for t in terms if _dense_rows(t, weight)]
    if (full and not FULL_SYRK or not dense or rows < SYRK_MIN_ROWS
            or out.device.type != "cpu" or not _blas_eligible(like)):
        return False
    rest = [t for t in terms if not _dense_rows(t, weight)]
    if _syrk_bytes(rest, n, mode, like.element_size(), C) > spare:
        return False
    with _blas_threads(1):
        if not _holds_blas():  # another thread's call holds SciPy's BLAS: the panels
            return False
        direct = out.is_contiguous() and out.dtype == like.dtype
        acc = (out.view(rows, rows) if direct else
               torch.empty((rows, rows), dtype=like.dtype, device=like.device))
        syrk = _syrk(acc)
        acc.zero_()
        for t in dense:
            syrk(t.delta.reshape(rows, -1), alpha=len(t.inputs) / (1 if full else C))
    if rest:
        _add_upper(acc, rest, mode, weight, layout)
    _mirror(acc, ADD_ROWS)
    if not direct:
        out.copy_(acc.view(out.shape))
    return True


def _syrk_bytes(rest: list[Term], n: int, mode: str, itemsize: int, C: int = 1) -> int:
    """Bytes that :func:`_syrk_block` may take beside the Gram for a block of ``n`` rows
    (``C`` outputs): the SYRK's square (counted also where it writes into the Gram itself,
    so that every output dtype takes the same route), and the panel of :func:`_add_upper`
    with the products of the other terms ``rest`` (a rank-one term's two, a position
    pair's intermediates)."""
    c2 = C * C if mode == "full" else 1
    per_pair = 0
    if rest:
        per_pair = 3 * itemsize * c2 + sum(pair_bytes(t, mode, itemsize) for t in rest
                                           if not rank_one(t))
    return n * n * c2 * itemsize + min(_add_rows(mode, C), n) * n * per_pair


def _add_rows(mode: str, C: int) -> int:
    """Samples per panel of :func:`_add_upper`: ``ADD_ROWS`` rows of its square."""
    return max(1, ADD_ROWS // C) if mode == "full" else ADD_ROWS


def _add_upper(K: torch.Tensor, terms: list[Term], mode: str, weight, layout) -> None:
    """Add the terms' Gram to the upper triangle of the square ``K`` (and to some entries
    below it, which the mirror overwrites), a panel of rows at a time (:func:`_add_rows`;
    "full": ``K`` is the ``(n C, n C)`` square of sample and output)."""
    n, C = terms[0].delta.shape[:2]
    full = mode == "full"
    rows = _add_rows(mode, C)
    if full:
        K = K.view(n, C, n, C)
    scratch = _Scratch()
    terms = _folded(terms, weight)
    for s in range(0, n, rows):
        e = min(s + rows, n)
        block = scratch.get((e - s, C, n - s, C) if full else (e - s, n - s), K)
        _gram_into(block, _rows(terms, slice(s, e)), _rows(terms, slice(s, n)), mode, weight,
                   layout)
        (K[s:e, :, s:, :] if full else K[s:e, s:]).add_(block)


def _symmetric_panels(terms: list[Term], mode: str, weight, layout, out: torch.Tensor,
                      panels: _Panels | None = None, scratch=None) -> None:
    """:func:`_symmetric_block` by torch's GEMMs, one outer panel of rows at a time;
    ``scratch``: where the products are written (:func:`_accumulate`, :func:`_folded`)."""
    n = terms[0].delta.shape[0]
    width = max(t.delta.shape[1] * t.delta.shape[3] for t in terms)
    terms = _folded(terms, weight, scratch)
    outer, inner = _panel_rows(terms[0].delta.device, width)
    for s in range(0, n, outer):
        e = min(s + outer, n)
        if e < n:
            _upper(out, terms, slice(s, e), slice(e, n), mode, weight, layout, panels,
                   scratch)
        for t in range(s, e, inner):
            u = min(t + inner, e)
            _upper(out, terms, slice(t, u), slice(t, e), mode, weight, layout, panels,
                   scratch)


def _panel_entries(n: int, outer: int, inner: int) -> int:
    """The most entries of one panel of :func:`_symmetric_panels` on ``n`` rows."""
    most = 0
    for s in range(0, n, outer):
        e = min(s + outer, n)
        most = max(most, (e - s) * (n - e), min(inner, e - s) * (e - s))
    return most


def _upper(out, terms, rows: slice, cols: slice, mode, weight, layout, panels,
           scratch=None) -> None:
    """``out[rows, cols]`` and its mirror, for ``cols`` starting at or after ``rows``."""
    full = mode == "full"
    target = out[rows, :, cols, :] if full else out[rows, cols]
    block = target if panels is None else panels.get(target.shape)
    _gram_into(block, _rows(terms, rows), _rows(terms, cols), mode, weight, layout, scratch)
    square = rows.stop - cols.start if cols.start == rows.start else 0
    if not full:
        _write_upper(out, block, target, rows.start, cols.start, square)
        return
    if square:
        diag = block[:, :, :square, :]
        diag.copy_(0.5 * (diag + diag.permute(2, 3, 0, 1)))
    if block is not target:
        target.copy_(block)
    out[cols.start + square : cols.stop, :, rows, :] = block[:, :, square:, :].permute(2, 3, 0, 1)


def _write_upper(out, block, target, r0: int, c0: int, square: int) -> None:
    """Write a trace Gram's panel ``block``, computed for ``target = out[r0:, c0:]``
    (``block`` itself or a float32 buffer of it), and its mirror below the diagonal:
    the first ``square`` columns straddle the diagonal and are symmetrised."""
    if square:
        diag = block[:, :square]
        torch.mul(diag + diag.T, 0.5, out=diag)  # one copy fewer than diag.copy_(...)
    if block is not target:
        target.copy_(block)
    out[c0 + square : c0 + block.shape[1], r0 : r0 + block.shape[0]] = block[:, square:].T


class _Panels:
    """Where a Gram's panels are computed when the result has a wider dtype.

    A float32 network's K returned as float64: each panel is computed in float32 here
    and widened as it is written (exactly: every float32 is a float64), so that K is
    never held twice, in float32 and again in float64, and K equals the float32 Gram
    converted afterwards bit for bit.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, arena=None):
        # The panel in ``arena``'s region "panel" (an :class:`._stacked.Arena`) where
        # given, else in a buffer of its own.
        self._arena = arena
        if arena is None:
            self._scratch = _Scratch()
            self._like = torch.empty(0, dtype=dtype, device=device)

    def get(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self._arena is not None:
            return self._arena.get("panel", shape)
        return self._scratch.get(shape, self._like)


def _block_size(n_rows: int, budget: int, per_row: int, per_pair: int = 0,
                what: str = "A tangent-kernel block") -> int:
    """Largest b with 2 b per_row + b^2 per_pair <= budget (at most n_rows).

    A budget too small for a single row is refused before any work, naming the bytes.
    """
    per_row = max(per_row, 1)
    rows_per_block(budget, 2 * per_row + per_pair, what)
    if per_pair <= 0:
        b = budget // (2 * per_row)
    else:
        b = (-2 * per_row + math.sqrt(4 * per_row**2 + 4 * per_pair * budget)) / (2 * per_pair)
    return int(max(1, min(n_rows, b)))


class _NewMisfit(Exception):
    """A block's capture found a parameter read outside its layer that earlier blocks
    did not: every block must be recomputed with the same routing."""

    def __init__(self, exclude: frozenset[str]):
        super().__init__(sorted(exclude))
        self.exclude = exclude


def _holds_module(fn):
    """Run ``fn(module, ...)`` holding :func:`.module_lock` of ``module`` (reentrant).

    The engine swaps the module's parameters for the call's (``functional_call``) and
    hooks its rule layers for each capture: two calls on one module from different
    threads (joblib's threading backend, Dask's threaded workers, a server sharing a
    network) read each other's parameters and captures, raised "One of the
    differentiated Tensors does not require grad", returned Grams off by up to 0.72
    (relative) without a word, and left the module holding another call's tensors as its
    parameters (``benchmarks/results/threads-s47.md``); a call's route (the plain CNN's,
    the stacked MLP's, which refuse hooked layers) depended on another call's hooks. They
    take turns instead, as the estimators' verbs do (which hold the same lock).
    """

    @functools.wraps(fn)
    def wrapper(module, *args, **kwargs):
        with module_lock(module):
            return fn(module, *args, **kwargs)

    return wrapper


def _consistent_routing(fn):
    """Rerun ``fn`` with the larger exclusion set when a block finds a new misfit.

    The two sides' terms are paired by position, so every block of one call must route
    the same parameters to the fallback. Usually the probe rows find every misfit; a
    use that depends on the data (Python control flow on tensor values) can show up in a
    later block only, and then the call starts over (at most once per such parameter).
    """

    @functools.wraps(fn)
    def wrapper(*args, exclude=frozenset(), **kwargs):
        while True:
            try:
                return fn(*args, exclude=frozenset(exclude), **kwargs)
            except _NewMisfit as new:
                exclude = new.exclude

    return wrapper


class _Blocks:
    """The captures of consecutive row blocks of X, kept or recomputed on demand.

    ``dense`` names the terms (by their first parameter) that the call contracts as
    per-sample gradient blocks: each block's capture hands them on formed. With ``chunk``
    a block is captured ``chunk`` rows at a time, each chunk's blocks formed in place in
    the block's buffers. Without ``keep``, :meth:`hold` keeps one block for its next use.
    ``reuse``: a dict, kept by the caller, of the buffers those chunked blocks are formed
    in; blocks of an earlier ``_Blocks`` formed there are overwritten (the output groups
    of a trace, each summed before the next is captured: a fresh block faults in every
    page of it). ``order``: the blocks' row order (:func:`._contract.dense_grad`), "any"
    for a trace without a preconditioner. ``given``: a capture of X's rows taken already
    (:func:`_prepared`), the first block's where that block is all of X in one capture.
    """

    def __init__(self, module, params, X, size, outputs, budget, keep, exclude=frozenset(),
                 dense=frozenset(), chunk=None, scale=None, reuse=None, order="flat",
                 given=None):
        self.module, self.params, self.X, self.exclude = module, params, X, exclude
        self.outputs, self.budget, self.keep = outputs, budget, keep
        self.dense, self.chunk, self.scale, self.order = dense, chunk, scale, order
        self.slices = [slice(s, min(s + size, X.shape[0])) for s in range(0, X.shape[0], size)]
        self._cache: dict[int, Capture] = {}
        self._held: tuple[int, Capture] | None = None
        self._scratch: list[torch.Tensor] = []
        self._reuse = reuse
        n = X.shape[0]
        self._given = (given if given is not None and len(self.slices) == 1
                       and (chunk is None or chunk >= n) else None)
        # The layer outputs are handed on uncopied until a capture finds one rewritten in
        # place (see capture's copy_sites); the later chunks copy them from the start.
        self._copy_sites = False
        # Likewise the saved tensors are held copy-on-write once a capture found one
        # rewritten in place (capture's guard_saved): the later chunks skip the first run.
        self._guard_saved = False
        # Eval BatchNorms folded into their convolutions (capture's fold_bn) until a
        # capture finds a folded convolution's output read elsewhere.
        self._fold_bn = True
        # The forward passes kept for the captures of the same rows by later output
        # groups (capture's ``kept``, by rows), and whether this is the last group.
        self.forwards: dict | None = None
        self.last = True
        # A plain CNN's captures compute its backprops by hand (:mod:`._cnn`): the same
        # terms without the use watch and the autograd graph. On the CPU, where it was
        # measured; a GPU keeps autograd's passes until a GPU run times and checks it.
        self._cnn = (plain_cnn(module, list(params)) if not exclude and X.ndim == 4
                     and X.is_floating_point() and X.device.type == "cpu"
                     and all(p.dtype == X.dtype and p.device == X.device
                             for p in params.values()) else None)

    def __len__(self):
        return len(self.slices)

    def _capture(self, rows: slice, scratch=None) -> Capture:
        kept = None
        if self.forwards is not None:
            key = (rows.start, rows.stop)
            kept = self.forwards.pop(key, {}) if self.last else \
                self.forwards.setdefault(key, {})
        if self._cnn is not None and kept is None:
            return plain_cnn_capture(self._cnn, self.params, self.X[rows], self.outputs,
                                     exclude=self.exclude, scratch=scratch,
                                     formed=self.dense, copied=self._copy_sites)
        cap = capture(self.module, self.params, self.X[rows], self.outputs,
                      memory_budget=self.budget, exclude=self.exclude, scratch=scratch,
                      index=True, formed=self.dense, copy_sites=self._copy_sites,
                      kept=kept, last=self.last, guard_saved=self._guard_saved,
                      fold_bn=self._fold_bn)
        self._copy_sites = cap.copied
        self._fold_bn = self._fold_bn and cap.fold_bn
        self._guard_saved = self._guard_saved or cap.guarded
        routed = cap.exclude | cap.declined
        if routed != self.exclude:
            raise _NewMisfit(self.exclude | routed)
        return cap

    def __getitem__(self, i: int) -> Capture:
        if i in self._cache:
            return self._cache[i]
        if self._held is not None and self._held[0] == i:
            return self._held[1]
        sl = self.slices[i]
        n = sl.stop - sl.start
        if self.chunk is None or self.chunk >= n:
            cap = self._capture(sl) if self._given is None else self._given
            self._given = None
            cap.terms = _formed(cap.terms, self.dense, order=self.order)
        else:
            cap, terms = None, None
            for s in range(sl.start, sl.stop, self.chunk):
                # Every chunk's terms are copied into the block's before the next
                # capture: its backprops reuse one set of buffers.
                part = self._capture(slice(s, min(s + self.chunk, sl.stop)), self._scratch)
                if terms is None:
                    pool = None if self._reuse is None else self._reuse.setdefault(i, {})
                    cap, terms = part, _formed_empty(part.terms, self.dense, n, pool)
                _formed(part.terms, self.dense, terms, s - sl.start, self.order)
            cap.terms = terms
        if self.scale is not None:
            _scale(cap.terms, *self.scale)
        if self.keep:
            self._cache[i] = cap
        return cap

    def hold(self, i: int) -> Capture:
        """Block ``i``, kept until another block is held (the next row block of a
        symmetric Gram is the first column block of the current row)."""
        cap = self[i]
        self._held = (i, cap)
        return cap


def _formed(terms: list[Term], dense: frozenset[str], into: list[Term] | None = None,
            start: int = 0, order: str = "flat") -> list[Term]:
    """The terms with those named in ``dense`` as gradient blocks (one term per parameter),
    their rows in ``order`` (:func:`._contract.dense_grad`).

    ``into`` (from :func:`_formed_empty`) receives them at rows ``start:``, in place.
    """
    if into is None:
        out = []
        for term in terms:
            out.extend(densify(term, order) if term.inputs[0][0] in dense else [term])
        return out
    slots = iter(into)
    for term in terms:
        rows = slice(start, start + term.delta.shape[0])
        if term.inputs[0][0] in dense:
            for _, a in term.inputs:
                dense_grad(term, a, out=next(slots).delta[rows, :, 0], order=order)
            continue
        whole = next(slots)
        whole.delta[rows] = term.delta
        for (_, a), (_, b) in zip(whole.inputs, term.inputs):
            if a is not None:
                a[rows] = b
    return into


def _scale(terms: list[Term], root: torch.Tensor, layout) -> None:
    """Multiply formed (constant-input) terms by ``sqrt(D)`` over their parameter, in
    place: the block owns them (formed here, or a capture's own sums and Jacobians).
    An index term left unformed has its ``delta`` scaled by its ids' rows instead."""
    for term in terms:
        if term.rows is not None:
            start, size = layout[term.inputs[0][0]]
            term.delta = index_scaled(term, root[start : start + size]).delta
            continue
        ((name, a),) = term.inputs
        assert a is None, "only formed terms are scaled"
        start, size = layout[name]
        term.delta.mul_(root[start : start + size])


def _formed_empty(terms: list[Term], dense: frozenset[str], n: int,
                  pool: dict | None = None) -> list[Term]:
    """Uninitialised terms of ``n`` rows laid out as :func:`_formed` returns them, in the
    buffers of ``pool`` (one :class:`_Scratch` per tensor, in order) when given."""
    slots = iter(range(10**9))

    def new(t, *shape):
        if t is None:
            return None
        shape = (n, *(shape or t.shape[1:]))
        if pool is None:
            return t.new_empty(shape)
        return pool.setdefault(next(slots), _Scratch()).get(shape, t)

    out = []
    for t in terms:
        if t.inputs[0][0] in dense:
            C = t.delta.shape[1]
            out.extend(Term(delta=new(t.delta, C, 1, param_numel(t, a)), inputs=[(name, None)])
                       for name, a in t.inputs)
        else:
            out.append(dataclasses.replace(t, delta=new(t.delta),
                                           inputs=[(name, new(a)) for name, a in t.inputs]))
    return out


def _term_bytes(term: Term) -> int:
    size = term.delta.numel() * term.delta.element_size()
    return size + sum(a.numel() * a.element_size() for _, a in term.inputs if a is not None)


def _dense_bytes(term: Term, itemsize: int) -> int:
    """Bytes per sample of the term's per-sample gradient blocks."""
    C = term.delta.shape[1]
    return itemsize * C * sum(param_numel(term, a) for _, a in term.inputs)


def _prepare(module, params, X, output, memory_budget, exclude=frozenset(), check_hidden=True,
             Y=None):
    """``(params, outputs, mode, probe)``: the call's parameters and outputs, and the
    probe capture of the first row that sizes its blocks (see :func:`_prepared`)."""
    return _prepared(module, params, X, output, memory_budget, exclude, check_hidden, Y)[:4]


#: Most rows of a symmetric Gram whose autograd check runs on the Gram's own capture
#: (:func:`_own_check_rows`).
OWN_CHECK_ROWS = 16


def _own_check_rows(X: torch.Tensor, memory_budget: int) -> torch.Tensor | None:
    """The rows ``x0, ..., x_{n-1}, x0`` of a small ``X`` (2 to :data:`OWN_CHECK_ROWS`
    rows; X itself for one), whose one capture serves as the probe, as the rows of the
    autograd check and as the Gram's block (:func:`_prepared`); None where ``X`` has more
    rows, where the check's copies of them do not fit an eighth of the budget, or where
    the cycle's length is that of another axis of ``X`` (see
    :func:`._capture.check_rows`: the capture tells the samples by their count).

    A check of these rows is at least as strict as that of ``check_rows``' cycle of
    ``x0, x1, xl`` (for two or three rows it is that cycle): a closed cycle of all the
    samples is in no monotone order unless all of them tie on a sort's key (those three
    in ``check_rows``), and a forward pass that reorders only batches of more rows than
    three (``if len(x) > 3``) is checked on the very batch the Gram is computed from.
    """
    n = X.shape[0]
    if n == 1:
        return X
    if n > OWN_CHECK_ROWS or n + 1 in X.shape[1:]:
        return None
    if not _copies_fit(X, n + 1, memory_budget):
        return None
    return torch.cat([X, X[:1]])


#: Rows a call captures before a row's bytes are known: check_rows' cycle (x0, x1, xl, x0)
#: was always captured so, whatever the budget.
_UNPLANNED_ROWS = CHECK_SAMPLES + 1


def _unplanned_fits(module, params, X, rows, outputs, memory_budget, kw):
    """``(fits, one)``: whether a capture of ``rows`` of X's rows before the block plan
    (the small Gram's own rows, :func:`_own_check_rows`) keeps within ``memory_budget``;
    ``one`` the capture of ``x0`` taken to tell, else None. Up to :data:`_UNPLANNED_ROWS`
    rows, as many as the check always captured; more where ``x0``'s capture says they
    take at most half the budget, as the block plan sizes a block (:func:`_block_size`).
    Without this bound the own rows' capture ran at any budget: the graph-heavy network
    of ``tests/test_memory.py`` peaked at 21 MiB on 16 rows with a budget of 8 MiB."""
    if rows <= _UNPLANNED_ROWS:
        return True, None
    one = capture(module, params, X[:1], outputs, memory_budget=memory_budget, **kw)
    return 2 * rows * one.capture_bytes() <= memory_budget, one


def _prepared(module, params, X, output, memory_budget, exclude=frozenset(), check_hidden=True,
              Y=None, own=False):
    """:func:`_prepare` and, last, a capture of ``X``'s rows already taken there, or None.

    ``own``: a symmetric Gram of a few rows (:func:`_own_check_rows`) has the probe
    capture and the autograd check run on ``X, x0``, and its block is the first ``n``
    rows of that capture instead of a capture of its own: one forward and one backward
    pass per output fewer on the same rows, the check on the Gram's own factors (a small
    call is mostly these fixed costs, ``benchmarks/results/small_gram-s55.md``); without
    the check, its probe capture is of X's rows. Any other call whose checked rows begin
    with ``X`` (one or a few queries) takes them as well.
    """
    params = dict(params)
    if X.ndim < 1 or X.shape[0] == 0:
        raise ValueError("X must be a non-empty tensor of shape (n_samples, ...), got shape "
                         f"{tuple(X.shape)}.")
    if X.is_complex() or X.dtype == torch.bool:
        raise TypeError(f"X must hold real numbers or integer token ids, got {X.dtype}.")
    if Y is not None:
        # Before any work (the check below runs the network on X's rows and Y's).
        _check_y(X, Y)
    check_per_sample(module)
    n_outputs = forward(module, params, X[:1]).shape[1]
    outputs, mode = _resolve_output(output, n_outputs)
    # The first sample's factors give the per-row size of every block's factors, and the
    # capture finds the parameters read outside their layer (every block's capture
    # checks again, see _consistent_routing); the autograd check on the first two and
    # the last samples and the first again (check_rows) covers reads that torch functions
    # do not see, and rows reordered by the data (a sort of the batch before a layer).
    # The sites' outputs handed on uncopied, as the chunks hand them on (:class:`_Blocks`,
    # capture's ``copy_sites``; copied where one is rewritten in place, here as there):
    # the graph's bytes (:func:`_kept_forward_groups`) are then those a kept forward pass
    # of the chunks holds, not those of a pass holding a copy of every site's output
    # besides (13% more on the ViT row, which then lost the kept plan).
    kw = dict(exclude=exclude, index=True, measure_graph=True, copy_sites=False, fold_bn=True)
    if check_hidden:
        # A cross Gram of fewer rows in X than the check takes (one query against a
        # training set) checks rows of Y after X's: Y's blocks are batches that a forward
        # sorting its batch reorders (one row of X checked alone saw no sort, the Gram
        # 42% off; tests/test_tangent.py::test_a_cross_gram_of_one_query_checks_ys_rows).
        # Y's first and last, as X's are taken (_picks: Y's first rows may tie on a sort
        # key; its last unlike Y's first and the query).
        # Where those rows raise, the retry in order takes batches the Gram forms
        # (checked_capture's in_order), never X's rows and Y's in one: X's first two, or
        # Y's first two (the probe: a packed recurrent layer's rule takes a batch of one
        # that Y's blocks decline) and the query.
        checked, in_order = X, None
        if Y is not None and X.shape[0] < CHECK_SAMPLES and Y.device == X.device:
            picks = _picks(Y, CHECK_SAMPLES - X.shape[0], before=X)
            checked = torch.cat([X, Y[picks]])
            in_order = [X[:2]] if X.shape[0] > 1 else [Y[:2], X]
        # The check's batched pass over the outputs in the eighth of the budget that
        # captures take (session s53).
        batch_bytes = memory_budget // 8 if BATCHED_CHECK else 0
        group = _own_check_rows(X, memory_budget) if own and Y is None else None
        if group is not None and not _unplanned_fits(module, params, X, group.shape[0],
                                                     outputs, memory_budget, kw)[0]:
            group = None
        if group is not None:
            try:
                rows, probe, hidden = _checked(module, params, [group], outputs,
                                               memory_budget, batch_bytes, kw)
            except Exception:
                # A network that refuses these rows (one needing its batch sorted): the
                # check of check_rows, which knows such networks, raises what they raise.
                group = None
        if group is None:
            rows, probe, hidden = checked_capture(module, params, checked, outputs,
                                                  memory_budget=memory_budget,
                                                  batch_bytes=batch_bytes, in_order=in_order,
                                                  **kw)
    else:
        # Unchecked (a path's steps after hidden_reads): a small symmetric Gram's probe
        # capture is of all its rows, and is its block.
        small, probe = own and Y is None and X.shape[0] <= OWN_CHECK_ROWS, None
        if small:
            small, probe = _unplanned_fits(module, params, X, X.shape[0], outputs,
                                           memory_budget, kw)
        rows, hidden = (X if small else X[:1]), frozenset()
        if small or probe is None:
            probe = capture(module, params, rows, outputs, memory_budget=memory_budget, **kw)
    if hidden:
        rows = X[:1]
        probe = capture(module, params, rows, outputs, memory_budget=memory_budget,
                        exclude=probe.exclude | hidden, index=True, measure_graph=True,
                        copy_sites=False, fold_bn=True)
    # The probe's first row sizes the blocks. Rule layers it declined go to the fallback
    # in every block alike (the terms of two blocks are paired by position).
    own_rows = None
    if not hidden and rows.shape[0] >= X.shape[0] and torch.equal(rows[:X.shape[0]], X):
        own_rows = dataclasses.replace(probe, terms=_rows(probe.terms, slice(0, X.shape[0])))
    probe = Capture(terms=_rows(probe.terms, slice(0, 1)), fallback=probe.fallback,
                    exclude=probe.exclude | probe.declined,
                    graph_bytes=-(-probe.graph_bytes // rows.shape[0]),
                    input_bytes=-(-probe.input_bytes // rows.shape[0]))
    return params, outputs, mode, probe, own_rows


@_holds_module
def hidden_reads(
    module: torch.nn.Module,
    points: Sequence[Mapping[str, torch.Tensor]],
    rows: Sequence[torch.Tensor],
    *,
    output: str | int = "trace",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> frozenset[str]:
    """Parameters to route to the fallback, checked at several points and samples.

    Runs the use watch and the autograd check of a few samples (see
    :func:`tangent_gram`'s ``check_hidden``) at every parameter point in ``points`` for
    each tensor in ``rows``. A path kernel or a decomposition checks the first, middle and
    last points of its path once, then calls the engine with ``exclude=`` this set and
    ``check_hidden=False`` at every step; the use watch still runs in every capture.
    """
    exclude: frozenset[str] = frozenset()
    for params in points:
        for X in rows:
            exclude = _prepare(module, params, X, output, memory_budget, exclude)[3].exclude
    return exclude


def _matching(params, params_y) -> dict[str, torch.Tensor]:
    """params_y in params' order (the two sides' terms are paired by position)."""
    params_y = dict(params_y)
    if set(params_y) != set(params):
        raise ValueError(
            "params_y must name the same parameters as params; missing "
            f"{sorted(set(params) - set(params_y))}, extra {sorted(set(params_y) - set(params))}."
        )
    bad = [k for k, v in params.items() if params_y[k].shape != v.shape]
    if bad:
        raise ValueError(f"params_y has shapes that differ from params for {bad}.")
    return {k: params_y[k] for k in params}


def _check_weight(diag_weight, params, dtype, device):
    if diag_weight is None:
        return None
    n_params = sum(p.numel() for p in params.values())
    if diag_weight.shape != (n_params,):
        raise ValueError(
            f"diag_weight must have shape ({n_params},), got {tuple(diag_weight.shape)}."
        )
    return diag_weight.to(device=device, dtype=dtype)


def _gram_plan(probe, n_x, n_y, mode, weighted, symmetric, budget, itemsize, scalable=True):
    """Routes of a Gram's terms and the bytes that size its blocks.

    Returns ``(dense, kept, pair, scaled)``: the terms contracted as gradient blocks (by
    first parameter), the bytes per sample a block keeps (factors, or formed blocks), the
    bytes per pair of samples of the position-pair intermediates, and whether every term
    is formed and scaled by ``sqrt(D)`` in its block (a preconditioned Gram whose blocks
    all fit: ``J D J'^T = (J sqrt(D)) (J' sqrt(D))^T``, then plain GEMMs, each block
    formed once instead of every rank-one term at every panel).
    """
    n_kept = n_x + (0 if symmetric else n_y)
    if weighted and scalable:
        # Index terms whose position pairs are cheaper stay unformed (sqrt(D) scales their
        # deltas by their ids' rows); every other term is formed.
        paired = [t for t in probe.terms if t.rows is not None and gram_route(
            t, n_x, n_y, mode, True, symmetric, budget // 8, itemsize) == "pair"]
        formed = sum(_term_bytes(t) if any(t is u for u in paired)
                     else _dense_bytes(t, itemsize) for t in probe.terms)
        if formed * n_kept <= budget * 7 // 8:
            # Each formed term then holds one parameter (the scaling is per parameter).
            shared = {t.inputs[0][0] for t in probe.terms
                      if (len(t.inputs) > 1 or t.inputs[0][1] is not None)
                      and not any(t is u for u in paired)}
            return (frozenset(shared), formed,
                    sum(pair_bytes(t, mode, itemsize) for t in paired), True)
    dense, kept, pair = set(), 0, 0
    for term in probe.terms:
        route = gram_route(term, n_x, n_y, mode, weighted, symmetric, budget // 8, itemsize)
        if route == "dense" and any(a is not None for _, a in term.inputs):
            dense.add(term.inputs[0][0])
            kept += _dense_bytes(term, itemsize)
            continue
        kept += _term_bytes(term)
        if route == "pair":
            pair += pair_bytes(term, mode, itemsize)
    return frozenset(dense), kept, pair, False


def _check_y(X, Y):
    # The axes counted too: a scalar Y against X of scalars, (n,), has its trailing shape.
    if Y.ndim != X.ndim or Y.shape[1:] != X.shape[1:] or Y.dtype != X.dtype:
        shape = ", ".join(["n", *(str(d) for d in X.shape[1:])])
        raise ValueError(f"Y must be a {X.dtype} tensor of shape ({shape}) like X, "
                         f"got {Y.dtype} of shape {tuple(Y.shape)}.")


@_holds_module
@_consistent_routing
def tangent_gram(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    X: torch.Tensor,
    Y: torch.Tensor | None = None,
    *,
    output: str | int = "trace",
    diag_weight: torch.Tensor | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    params_y: Mapping[str, torch.Tensor] | None = None,
    exclude: frozenset[str] = frozenset(),
    check_hidden: bool = True,
    out_dtype: torch.dtype | None = None,
    blocks_last: bool = False,
) -> torch.Tensor:
    """Tangent-kernel Gram matrix ``J(X) D J(Y)^T`` without forming the Jacobian.

    Parameters
    ----------
    module : torch.nn.Module
        Network without cross-sample state; evaluated with ``functional_call``.
    params : mapping of str to torch.Tensor
        The differentiated parameters, in flat (trajectory) order; other parameters and
        buffers are the module's own.
    X : torch.Tensor of shape (n_samples_X, ...)
        Inputs as the module takes them: features, images, sequences, or int64 token ids.
    Y : torch.Tensor of shape (n_samples_Y, ...), default=None
        Same trailing shape and dtype as ``X``.
        ``None`` computes ``K(X, X)``, evaluating only the blocks on and above the
        diagonal and mirroring them (diagonal blocks are symmetrised exactly).
    output : "trace", "full" or int, default="trace"
        "trace": ``trace(J(x) D J(y)^T) / C`` (neural-tangents' trace_axes); int: that
        output's kernel; "full": the ``C x C`` blocks.
    diag_weight : torch.Tensor of shape (n_params,), default=None
        Diagonal preconditioner ``D`` (e.g. Adam's ``1 / (sqrt(v_hat) + eps)``); ``None``
        is the identity. With ``D``, the per-layer rank-one structure is lost: the
        per-sample gradients of one parameter are materialised for a row block and a
        column block, scaled by ``D``, and multiplied by a GEMM (``O(N M P)`` flops, the
        dense cost, but memory-bounded and never holding more than one parameter's block).
    memory_budget : int, default=2**30
        Bytes that one block's factors and intermediates may use (the returned Gram is
        not counted).
    params_y : mapping of str to torch.Tensor, default=None
        Evaluate the ``Y`` side at these parameters instead: the cross-parameter Gram
        ``J(X; params) D J(Y; params_y)^T`` (the exact decomposition pairs queries on a
        step's segment with the batch at the step's start). Same names and shapes as
        ``params``.
    exclude : frozenset of str, default=frozenset()
        Parameters whose layers must use the generic fallback. Layers with a parameter
        read outside their own call are found by every capture and added to these.
    check_hidden : bool, default=True
        Run the autograd check of a few samples (:func:`._capture.check_rows`) for
        reads that torch functions do not see (TorchScript, C++ extensions) and for a
        forward pass that reorders the samples before a rule layer. A caller evaluating
        many points of one path runs it once with :func:`hidden_reads` and passes the
        result as ``exclude``.
    out_dtype : torch.dtype, default=None
        The dtype of the returned Gram; ``None``: the computation's. A wider one (float64
        for a float32 network) equals the Gram converted afterwards, bit for bit, without
        holding it twice: every panel is computed in a reused buffer of the
        computation's dtype and widened as it is written.
    blocks_last : bool, default=False
        For "full": return ``(n_X, n_Y, C, C)`` (each pair's ``C x C`` block contiguous,
        neural-tangents' layout) instead of ``(n_X, C, n_Y, C)``. The blocks are written
        into that layout directly, so the Gram is never held in both.

    Returns
    -------
    K : torch.Tensor of shape (n_samples_X, n_samples_Y), or (n_X, C, n_Y, C) for "full"
        (``(n_X, n_Y, C, C)`` with ``blocks_last``)
    """
    if params_y is not None:
        params_y = _matching(params, params_y)
    elif Y is None and diag_weight is None and not exclude:
        # Without autograd: its ``out=`` products refuse operands that require grad (the
        # module's own parameters, or an X that requires grad), which the capture takes.
        with torch.no_grad():
            K = _plain_mlp_gram(module, params, X, output, memory_budget, out_dtype)
        if K is not None:
            return K
    symmetric = Y is None and params_y is None
    params, outputs, mode, probe, given = _prepared(module, params, X, output, memory_budget,
                                                    exclude, check_hidden, Y, own=symmetric)
    dtype = value_dtype(params, X)
    weight = _check_weight(diag_weight, params, dtype, X.device)
    weight = None if weight is None else _Weighted(weight)
    Y = X if Y is None else Y
    params_y = params if params_y is None else params_y
    layout = _layout(params)
    n, m, n_out = X.shape[0], Y.shape[0], len(outputs)
    out_dtype = dtype if out_dtype is None else out_dtype
    groups = _output_groups(probe, n, m, mode, weight, symmetric, memory_budget,
                            dtype.itemsize)
    if len(groups) > 1:
        # The output groups capture their own rows: the probe's capture of X's (a small
        # Gram's, see _prepared) would be held beside them for nothing.
        given = None
        kept = _kept_forward_groups(probe, n, mode, weight, memory_budget,
                                    dtype.itemsize) if symmetric else None
        shared = kept is not None and len(kept) > 1
        return _grouped_gram(module, params, params_y, X, Y, outputs, groups, probe, weight,
                             layout, symmetric, memory_budget, dtype, out_dtype,
                             kept if shared else None)
    bx, by, weight, dense = _gram_blocks(module, params, params_y, X, Y, outputs, mode, probe,
                                         weight, layout, symmetric, memory_budget,
                                         dtype.itemsize, given=given)
    given = None  # the blocks hold it where they use it, and drop it where they do not
    if mode != "full":
        # NumPy's memory (huge pages, see large_tensor): first writing a fresh 1024^2
        # float64 K faulted 2,048 pages from torch's allocator (2.4 ms), 514 (1.1 ms)
        # from NumPy's, of a 40 ms public call (benchmarks/results/gram-faults-s44.md).
        K = result = large_tensor((n, m), out_dtype, X.device)
    elif blocks_last:
        # The engine fills (n, C, m, C) views: a permuted view of the (n, m, C, C) result.
        result = large_tensor((n, m, n_out, n_out), out_dtype, X.device)
        K = result.permute(0, 2, 1, 3)
    else:
        K = result = large_tensor((n, n_out, m, n_out), out_dtype, X.device)
    panels = None if out_dtype == dtype else _Panels(dtype, X.device)
    # A SYRK's buffers take the eighth of the budget that captures take (none runs while a
    # diagonal block is multiplied) or, for blocks of factors, the products' share.
    _fill_gram(K, bx, by, mode, weight, layout, symmetric, dense, panels, memory_budget // 8)
    return result


def _plain_mlp_gram(module, params, X, output, memory_budget, out_dtype):
    """``K(X, X)`` of a plain MLP with one output (an ``nn.Sequential`` of ``nn.Linear``
    and elementwise activations, :func:`._stacked.stacked_mlp`) whose factors fit one
    block, from factors computed without a capture (:func:`._stacked.gram_factors`);
    None where this route does not apply (the general one then runs).

    The same factors as the capture's, bit for bit, and the same symmetric panels, so
    the same K; what it leaves out is the capture's set-up for modules of any kind:
    :func:`_prepare`'s probe capture and autograd check of a few samples (a module of
    these exact types, without hooks, reads its parameters only in its layers' own calls
    and keeps its rows in the samples' order), the use watch and the autograd graph, and
    the factors' fresh memory (one arena instead, :class:`._stacked.Arena`). Public call
    on 64-512-512-1 tanh at N = 1024, one thread: ``benchmarks/results/gram-mlp-s46.md``.
    """
    params = dict(params)
    if not ((isinstance(output, str) and output == "trace")
            or (isinstance(output, int) and not isinstance(output, bool) and output in (0, -1))):
        return None
    mlp = stacked_mlp(module, list(params))
    if (mlp is None or X.ndim != 2 or not X.is_floating_point() or X.shape[0] == 0
            or X.shape[1] != mlp.n_inputs or mlp.linears[-1].d_out != 1
            or not isinstance(mlp.items[-1], type(mlp.linears[-1]))
            or any(p.dtype != X.dtype or p.device != X.device for p in params.values())):
        return None
    # Parameters of the layers' own shapes: a broadcast bias (shape (1,)) would be taken
    # for one entry per unit, where the general route refuses it.
    shapes = {lin.weight: (lin.d_out, lin.d_in) for lin in mlp.linears}
    shapes.update({lin.bias: (lin.d_out,) for lin in mlp.linears if lin.bias is not None})
    if any(tuple(params[k].shape) != shape for k, shape in shapes.items()):
        return None
    n, itemsize = X.shape[0], X.element_size()
    # One block, as the general route sizes it (:func:`_gram_blocks`): the factors of a
    # row (a Linear's input and backprop) four times per row, two sides, and the panel
    # products per pair.
    per_row = 4 * itemsize * sum(lin.d_in + lin.d_out for lin in mlp.linears)
    if 2 * n * per_row + n * n * 5 * itemsize > memory_budget:
        return None
    out_dtype = X.dtype if out_dtype is None else out_dtype
    outer, inner = _panel_rows(X.device, max(lin.d_out for lin in mlp.linears))
    panel = _panel_entries(n, outer, inner)
    head = mlp.linears[-1]
    # The layers' terms in the order of their first parameter in ``params``, as the
    # capture gives them: the panels sum them in that order (the same bits for a dict
    # in another order than the module's).
    names = {name: i for i, name in enumerate(params)}
    order = sorted(range(len(mlp.linears)), key=lambda li: min(
        names[k] for k in (mlp.linears[li].weight, mlp.linears[li].bias) if k is not None))
    # Every buffer of the call but K in one allocation: the factors, the folded head
    # (its inputs and the bias's 1), the panels' two products and, for a wider K, the
    # panel computed in X's dtype.
    in_fold = _head_in_fold(mlp)
    sizes = {**gram_factor_sizes(mlp, n, in_fold), "gd": panel, "ga": panel,
             ("fold", order.index(len(mlp.linears) - 1)):
             n * (head.d_in + (head.bias is not None))}
    if out_dtype != X.dtype:
        sizes["panel"] = panel
    arena = Arena(sizes, X.dtype, X.device)
    fold = None
    if in_fold:
        fold = arena.get(("fold", order.index(len(mlp.linears) - 1)),
                         (n, head.d_in + (head.bias is not None)))[:, : head.d_in]
    factors = gram_factors(mlp, params, X, arena, fold)
    # The route computes the layers' operations itself: a module whose forward is not
    # theirs (what the type checks cannot see) takes the general route. Checked on the
    # first sample: the module's output against the head applied to the factors.
    head_w, a, head_b, _ = factors[-1]
    ours = torch.nn.functional.linear(a[:1], params[head_w],
                                      None if head_b is None else params[head_b])
    # (forward copies the row: an in-place activation before the first Linear would
    # overwrite the caller's first row.)
    ref = forward(module, params, X[:1])
    # Relative to the output's terms, ``|a| |W|^T + |b|``, the scale of the rounding of
    # the module's other GEMMs (one sample against the block): an output that cancels to
    # near 0 made that rounding look like another forward (3 of 60 random 64-512-512-1
    # tanh networks at N = 256 left the route so: 101-282 eps of the output, 0.12-0.31
    # eps of its terms; ``benchmarks/results/review-plain-mlp-s46.md``).
    magnitude = a[:1].abs() @ params[head_w].abs().T
    if head_b is not None:
        magnitude += params[head_b].abs()
    scale = magnitude.max().clamp_min(torch.finfo(X.dtype).tiny)
    if not float((ours - ref).abs().max() / scale) <= 100 * torch.finfo(X.dtype).eps:
        return None
    terms = [Term(delta=d.view(n, 1, 1, -1),
                  inputs=[(w, a.view(n, 1, -1))] + ([] if b is None else [(b, None)]))
             for w, a, b, d in (factors[li] for li in order)]
    if fold is not None and factors[-1][1] is fold:
        # The head's input was written into its folded rows ``[g a, g]`` (:func:`_folded`),
        # whose ``g`` is 1 for every sample (the scalar output's own gradient): they are
        # ``[a, 1]``, without the pass that forms them (the same numbers).
        rows = arena.get(("fold", order.index(len(mlp.linears) - 1)),
                         (n, head.d_in + (head_b is not None)))
        rows[:, head.d_in :] = 1
        terms[order.index(len(mlp.linears) - 1)] = Term(delta=rows[:, None, None, :],
                                                          inputs=[(head_w, None)])
    K = large_tensor((n, n), out_dtype, X.device)
    panels = None if out_dtype == X.dtype else _Panels(X.dtype, X.device, arena)
    # (:func:`_symmetric_block`'s SYRK takes terms of dense rows only: none here.)
    # The panels' rows as the arena's panels were sized: by the layers' backprop widths
    # (:func:`_symmetric_panels`' ``width``, taken before the head is folded into rows of
    # ``d_in + 1``, which would choose wider panels from a head of 16,383 inputs or more).
    _plain_panels(_folded(terms, None, arena), K, panels, arena, (outer, inner))
    return K


def _head_in_fold(mlp) -> bool:
    """Whether :func:`._stacked.gram_factors` writes the last hidden Linear's output into
    the first ``d_in`` columns of the folded head's rows ``[a, 1]`` (:func:`_folded`) on
    the plain-MLP route, so that the head's input is already there, with the same bits.

    Only where nothing but one activation that ``gram_factors`` runs in place over that
    output (``_IN_PLACE``: tanh, sigmoid, ReLU) and identities come between the two
    Linears, and the head's ``d_in`` is a multiple of 64: every row of the strided view
    is then a whole number of the vectorised kernels' steps, as the contiguous buffer
    is, so no entry falls to a scalar tail, whose sigmoid rounds otherwise (measured
    for widths that are not multiples of 32).
    """
    head = mlp.linears[-1]
    if len(mlp.linears) < 2 or head.d_in % 64:
        return False
    last = max(i for i, it in enumerate(mlp.items) if it is mlp.linears[-2])
    between = [it for it in mlp.items[last + 1 : -1] if type(it) is not torch.nn.Identity]
    return not between or (len(between) == 1 and type(between[0]) in _IN_PLACE)


def _plain_panels(terms: list[Term], out: torch.Tensor, panels: _Panels | None,
                  arena, rows: tuple[int, int]) -> None:
    """:func:`_symmetric_panels` of the plain-MLP route's terms (a trace without a
    preconditioner, one output, one position; folded by :func:`_folded`), by the same
    operations in the same order, so the same bits, without the generic route's Python
    per panel (the terms' row views rebuilt as dataclasses, the term checks of
    :func:`_accumulate`): each term is reduced once to its matrices, ``(d, a, ones)`` for
    ``(a . a' + ones) (d . d')`` or ``(g, None, alpha)`` for the dense rows ``alpha g g'``,
    and the panels slice those. ``rows``: the outer and inner panels' rows
    (:func:`_panel_rows`), those that the arena's products were sized for.
    """
    n = out.shape[0]
    mats = []
    for t in terms:
        d = t.delta.reshape(n, -1)
        factored = [a[:, 0] for _, a in t.inputs if a is not None]
        if all(a is None for _, a in t.inputs):
            mats.append((d, None, float(len(t.inputs))))
        else:
            mats.append((d, factored, len(t.inputs) - len(factored)))
    outer, inner = rows
    for s in range(0, n, outer):
        e = min(s + outer, n)
        if e < n:
            _plain_upper(out, mats, s, e, e, n, panels, arena)
        for t in range(s, e, inner):
            _plain_upper(out, mats, t, min(t + inner, e), t, e, panels, arena)


def _plain_upper(out, mats, r0: int, r1: int, c0: int, c1: int, panels, arena) -> None:
    """``out[r0:r1, c0:c1]`` and its mirror from :func:`_plain_panels`' matrices: what
    :func:`_upper` and :func:`_accumulate` compute for those terms, op for op."""
    shape = (r1 - r0, c1 - c0)
    target = out[r0:r1, c0:c1]
    block = target if panels is None else panels.get(shape)
    first = True
    for d, factored, ones in mats:
        if factored is None:  # dense rows: one GEMM into the block
            block.addmm_(d[r0:r1], d[c0:c1].T, beta=0 if first else 1, alpha=ones)
            first = False
            continue
        Gd = torch.mm(d[r0:r1], d[c0:c1].T, out=arena.get("gd", shape))
        Ga = None
        for a in factored:
            if Ga is None:
                Ga = torch.mm(a[r0:r1], a[c0:c1].T, out=arena.get("ga", shape))
            else:
                Ga.addmm_(a[r0:r1], a[c0:c1].T)
        if Ga is None:
            if first:
                torch.mul(Gd, ones, out=block)
            else:
                block.add_(Gd, alpha=ones)
        else:
            if ones:
                Ga += ones
            if first:
                torch.mul(Gd, Ga, out=block)
            else:
                block.add_(Gd.mul_(Ga))
        first = False
    _write_upper(out, block, target, r0, c0, r1 - c0 if c0 == r0 else 0)


def _gram_blocks(module, params, params_y, X, Y, outputs, mode, probe, weight, layout,
                 symmetric, memory_budget, itemsize, reuse=(None, None), held=0, counted=0,
                 given=None):
    """The row and column blocks of a Gram, sized to the budget by the plan's route.

    ``reuse``: for the row and the column blocks, where their formed gradient blocks are
    kept (see :class:`_Blocks`), when earlier blocks held there are no longer used.
    ``held``: bytes the caller holds within the budget meanwhile (output groups' sums).
    ``counted``: bytes per row of a capture chunk that the caller counts apart (the kept
    forward passes' graphs, :func:`_kept_forward_groups`). ``given``: a capture of X's
    rows taken already (see :class:`_Blocks`).

    Returns ``(bx, by, weight, dense)``: ``weight`` is None where the blocks carry the
    preconditioner's square root themselves; ``dense`` whether blocks are formed
    per-sample gradients.
    """
    n_out = len(outputs)
    # Whole rows are multiplied only by a trace without D: their entries' order is free.
    order = "any" if mode == "trace" and weight is None else "flat"
    # A D with negative entries has no square root: the panels then scale the blocks.
    dense, kept, pair, scaled = _gram_plan(
        probe, X.shape[0], Y.shape[0], mode, weight is not None, symmetric, memory_budget,
        itemsize, scalable=weight is not None and bool((weight.values >= 0).all()))
    scale = None
    if scaled:
        # Every block is formed and scaled by sqrt(D) as it is captured; the products
        # are then those of an unweighted Gram.
        scale = (weight.values.sqrt(), layout)
        weight = None
    per_pair = itemsize * (3 * (n_out * n_out if mode == "full" else 1) + 2) + pair
    lazy = 0
    if weight is not None:
        # The rank-one terms' blocks, formed one parameter at a time per panel (index
        # terms that pair positions are not formed).
        paired = {t.inputs[0][0] for t in probe.terms
                  if t.rows is not None and t.inputs[0][0] not in dense}
        lazy = 2 * n_out * itemsize * max(
            [size for name, (_, size) in layout.items() if name not in paired], default=0)
    n_max = max(X.shape[0], Y.shape[0])
    n_kept = X.shape[0] + (0 if symmetric else Y.shape[0])
    chunk = None
    if dense:
        # Formed gradient blocks: the kept blocks (a row block, a column block and the
        # next row block) take 7/8 of the budget (3/4 at least); a block is captured in
        # chunks whose factors, graph and forming take the rest. (Shares of the budget
        # are passed as larger per-row needs, so that a refusal names the bytes of the
        # whole budget.)
        chunk, share = _dense_shares(probe, kept, memory_budget)
        size = _block_size(n_max, memory_budget,
                           -(-3 * (kept + lazy) * memory_budget // (2 * share)),
                           -(-per_pair * memory_budget // share))
        fits = _keeps_all(dense, kept, n_kept, memory_budget, share,
                          _panel_bytes(pair, n_max, X.device) if symmetric and not lazy else 0)
        if fits and symmetric and not lazy:
            # Every block is kept anyway: one block, the largest products. (Lazily formed
            # rank-one blocks of a preconditioned Gram grow with the block: not then.)
            size = n_max
        if fits and _wide_chunks(X.device):
            chunk = _launch_bound_chunk(probe, kept, n_kept, size, per_pair,
                                        memory_budget - held, chunk, counted)
    else:
        size = _block_size(n_max, memory_budget, probe.capture_bytes() + lazy, per_pair)
        # Captures are kept only where a block is visited again: the column blocks, once
        # per row block. A row block of a cross Gram is used once, keeping it would only
        # hold memory (N x r OOD passes: 140 MB of factors for nothing at N = 20000).
        fits = _keeps_all(dense, kept, n_kept, memory_budget)
    n_row_blocks = -(-X.shape[0] // size)
    bx = _Blocks(module, params, X, size, outputs, memory_budget,
                 fits and symmetric and n_row_blocks > 1, probe.exclude, dense, chunk, scale,
                 reuse[0], order, given)
    by = bx if symmetric else _Blocks(module, params_y, Y, size, outputs, memory_budget,
                                      fits and n_row_blocks > 1, probe.exclude, dense, chunk,
                                      scale, reuse[1], order)

    return bx, by, weight, dense


def _chunk_row_bytes(probe: Capture, kept: int) -> int:
    """Bytes per row of a chunk captured into formed blocks: its factors, graph,
    forming and copy of its rows (:meth:`.Capture.capture_bytes`), and what a
    convolution's weight formed by oneDNN holds beyond that (the largest layer's,
    :func:`._layers.formed_workspace`), in an eighth of the budget (see
    :func:`_gram_blocks`).

    Without the latter a float32 cross Gram of ``tests/test_tangent.py``'s ``_WideConvs``
    took 7-row chunks and held 4,258,084 bytes besides K at a 4 MiB budget on an AVX2 CPU:
    its dilated convolution's backward held 537,088 bytes of work buffers beside its
    129,024 of gradients (``benchmarks/results/host_zen3-s55.md``)."""
    workspace = max((formed_workspace(t, t.delta.element_size()) for t in probe.terms),
                    default=0)
    return 8 * (probe.capture_bytes() + kept + workspace)


def _dense_shares(probe: Capture, kept: int, budget: int) -> tuple[int, int]:
    """Rows of a capture chunk, and the bytes left to the kept formed blocks (a row
    block, a column block and the next row block): 7/8 of the budget, 3/4 at least."""
    captured = _chunk_row_bytes(probe, kept) // 8
    chunk = rows_per_block(budget, 8 * captured, "A capture of per-sample gradient blocks")
    if chunk < MIN_CHUNK:
        # A capture of a few rows runs every layer on tiny batches: 5-row chunks took
        # 1.6x the time of 16-row ones on the ResNet's ten outputs (one thread). Up to
        # a quarter of the budget goes to the chunk then, the rest to the blocks.
        chunk = max(chunk, min(MIN_CHUNK, budget // (4 * captured)))
    return chunk, budget - max(chunk * captured, budget // 8)


def _wide_chunks(device: torch.device) -> bool:
    """Whether capture chunks take what the kept blocks leave of the budget
    (:func:`_launch_bound_chunk`): on the CPU, not yet on a GPU.

    A capture is a forward and the outputs' backward passes, each with a cost per torch
    call whatever its rows. On the CPU (one thread) the ResNet's ten-output Gram at
    N = 1024 and the default budget takes 36-row chunks instead of 16 (145 captures
    instead of 320): against main's plan on a shared machine, 1.08x as fast by medians
    and 1.10x by least over five alternating rounds at load 1-4 (1.00-1.19x by round;
    0.90-1.28x in a run at load 5-9), the same K bit for bit, 771 MiB held of the 1024 MiB
    budget against 687; the ViT 1.11-1.18x at N = 512 (``benchmarks/results/
    wide_chunks.md``, ``wide_chunks_ab.md``). The chunk's
    bytes per row (:func:`_chunk_row_bytes`) are an estimate, not a bound, which an
    eighth of the budget absorbed; filling the rest with it held 9.4 MiB of a 16 MiB
    budget where the default held 2.8 on a long-sequence attention network
    (``benchmarks/results/gpu_choices_cpu.md``), and the tests of ``memory_budget``
    measure the peaks of the CPU's plan. A GPU takes them once a GPU run times them with
    their peak memory (``benchmarks/bench_gpu_ab.py``); 49.5 MiB of 16 with the batched
    pass there.
    """
    return device.type == "cpu"


def _launch_bound_chunk(probe: Capture, kept: int, n_kept: int, size: int, per_pair: int,
                        budget: int, chunk: int, counted: int = 0) -> int:
    """Rows of a capture chunk where the cost per torch call, not bytes, sets the pace (a
    GPU's launches, see :func:`._stacked._launch_bound`; the CPU's, :func:`_wide_chunks`)
    and every formed block is kept: what the kept blocks and a block pair's products leave
    of the budget, instead of an eighth of it.

    A capture is a forward and the outputs' backward passes whatever its rows: about 1100
    torch calls on the ResNet, 250 on the CNN. At N = 128 and the default budget the
    ResNet's Gram took 13 captures, 19,389 torch calls; 5 captures and 9,501 calls with
    these chunks (``benchmarks/results/gpu_choices_cpu.md``). On an H200 the call's time
    was its host's time issuing them (CPU time 0.40 s of 0.41 s,
    ``benchmarks/results/gram_nets-quick-cuda.md``). ``counted``: bytes per row of the
    chunk's estimate that the caller counts apart (a kept forward pass's graph).
    """
    captured = max(_chunk_row_bytes(probe, kept) // 8 - counted, 1)
    spare = budget - kept * n_kept - per_pair * size * size
    return max(chunk, min(size, spare // captured))


def _keeps_all(dense, kept: int, n_kept: int, budget: int, share: int | None = None,
               products: int = 0) -> bool:
    """Whether a Gram keeps every block's capture (none is recomputed): formed gradient
    blocks in ``share`` (:func:`_dense_shares`) beside the panels' ``products``
    (:func:`_panel_bytes`, those of the one block a symmetric Gram then has), factors in
    half of the budget."""
    return (kept * n_kept + products <= share) if dense else kept * n_kept <= budget // 2


def _panel_bytes(pair: int, n: int, device: torch.device) -> int:
    """The most bytes of the position pairs' intermediates (``pair`` per pair of rows,
    :func:`._contract.pair_bytes`) in one panel of :func:`_symmetric_panels` on a
    symmetric block of ``n`` rows (either panel size of :func:`_panel_rows`).

    Where every formed block is kept, the symmetric Gram is one block, whose panels'
    products the blocks' sizes do not count (:func:`_block_size` counts them where the
    blocks do not all fit): a small ViT whose patch embedding went by position pairs from
    two outputs on held 1.46x the budget in groups of two
    (``benchmarks/results/rev2-s46-kept-forwards.md``). The panels' other products (a
    rank-one term's two, a panel of another dtype) take the rest of the budget."""
    return pair * max(_panel_entries(n, *_panel_rows(device, width)) for width in (0, 2**14))


def _probe_outputs(probe: Capture, columns: Sequence[int]) -> Capture:
    """The probe with only some of its outputs' columns (it sizes the blocks only)."""
    index = list(columns)
    return dataclasses.replace(probe, terms=[dataclasses.replace(t, delta=t.delta[:, index])
                                             for t in probe.terms])


def _output_groups(probe, n_x, n_y, mode, weight, symmetric, budget,
                   itemsize) -> list[list[int]]:
    """Columns of the outputs, split into groups whose Grams are computed one at a time.

    The trace is a sum over the outputs, and a block's factors and formed gradient
    blocks grow with the outputs while its forward pass does not. When every block of all
    the outputs does not fit the budget, the blocks off the diagonal would be captured
    again for every row block (``k (k - 1) / 2`` captures of ``k`` blocks, each a forward
    and ``C`` backward passes); split into the fewest groups whose blocks all fit, each
    block is captured once per group: ``g - 1`` more forward passes, no more backward
    passes. One group when everything fits, when one output alone does not, or when the
    two ``(n_x, n_y)`` Grams that the sum needs do not fit an eighth of the budget.
    """
    C = probe.terms[0].delta.shape[1]
    if mode != "trace" or C == 1 or 2 * n_x * n_y * itemsize > budget // 8:
        return [list(range(C))]
    return _fitting_groups(probe, n_x, n_y, mode, weight, symmetric, budget, itemsize) \
        or [list(range(C))]


def _kept_forward_groups(probe, n, mode, weight, budget, itemsize) -> list[list[int]] | None:
    """Output groups of a symmetric trace whose captures share one forward pass per
    chunk: the graphs of all ``n`` rows (``probe.graph_bytes`` per row) kept beside the
    widest group's blocks, the groups the fewest that fit what the graphs leave of the
    budget; None where none fit (or a preconditioner: not taken there).

    :func:`_output_groups` captures every chunk once per group, a forward pass each
    (``g - 1`` more than one); keeping the forward passes' graphs until the last group
    runs one, at the cost of the graphs' bytes, which may split the outputs into more
    (narrower) groups: as many backward passes and forming, and the same products.
    """
    if weight is not None or probe.graph_bytes <= 0:
        return None
    left = budget - probe.graph_bytes * n
    if left <= 0 or 2 * n * n * itemsize > left // 8:
        return None
    return _fitting_groups(probe, n, n, mode, weight, True, left, itemsize)


def _fitting_groups(probe, n_x, n_y, mode, weight, symmetric, budget,
                    itemsize) -> list[list[int]] | None:
    """The fewest groups of outputs whose blocks all fit (see :func:`_output_groups`);
    None where none do."""
    C = probe.terms[0].delta.shape[1]
    n_kept = n_x + (0 if symmetric else n_y)
    scalable = weight is not None and bool((weight.values >= 0).all())
    for g in range(1, C + 1):
        width = -(-C // g)
        if g > 1 and width == -(-C // (g - 1)):
            continue  # the same widest group as g - 1
        part = _probe_outputs(probe, range(width))
        dense, kept, pair, scaled = _gram_plan(part, n_x, n_y, mode, weight is not None,
                                               symmetric, budget, itemsize, scalable)
        if g == 1 and dense and (_chunk_row_bytes(part, kept) > budget
                                 or 24 * kept > 7 * budget):
            return None  # refused with every output (the error names the bytes): alike
        if dense and _chunk_row_bytes(part, kept) > budget:
            continue
        share = _dense_shares(part, kept, budget)[1] if dense else None
        # The products as :func:`_gram_blocks` counts them (a preconditioner not folded
        # into the blocks forms rank-one blocks lazily, in blocks sized for them).
        lazy = weight is not None and not scaled
        products = _panel_bytes(pair, n_x, probe.terms[0].delta.device) \
            if symmetric and not lazy else 0
        if _keeps_all(dense, kept, n_kept, budget, share, products):
            bounds = [round(i * C / g) for i in range(g + 1)]
            return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    return None


def _grouped_gram(module, params, params_y, X, Y, outputs, groups, probe, weight, layout,
                  symmetric, budget, dtype, out_dtype, kept=None) -> torch.Tensor:
    """The trace Gram as the sum of its output groups' traces (see :func:`_output_groups`).

    The groups' Grams are summed in the computation's dtype and widened at the end, so a
    wider ``out_dtype`` is the float32 result converted, as for one group. ``kept``: the
    groups of :func:`_kept_forward_groups`, whose captures share one forward pass per
    chunk, its graph kept in what the budget leaves them; ``groups`` where their blocks
    refuse a single row in that rest.
    """
    n, m, C = X.shape[0], Y.shape[0], len(outputs)
    held = n * m * dtype.itemsize * (1 if out_dtype == dtype else 2)
    plans = None
    if kept:
        # (:func:`_fitting_groups` does not check every refusal of :func:`_gram_blocks`:
        # on a few rows, a block's single row can need more than the graphs leave of the
        # budget, where the groups' plan with the whole budget holds it.)
        with contextlib.suppress(ValueError):
            plans = _group_plans(module, params, params_y, X, Y, outputs, kept, probe,
                                 weight, layout, symmetric, budget - probe.graph_bytes * n,
                                 dtype, held, probe.graph_bytes)
    if plans is not None:
        groups, budget = kept, budget - probe.graph_bytes * n
    else:
        plans = _group_plans(module, params, params_y, X, Y, outputs, groups, probe, weight,
                             layout, symmetric, budget, dtype, held)
    K = torch.empty((n, m), dtype=out_dtype, device=X.device)
    total = K if out_dtype == dtype else torch.empty((n, m), dtype=dtype, device=X.device)
    part = torch.empty((n, m), dtype=dtype, device=X.device)
    for i, columns in enumerate(groups):
        bx, by, w, dense = plans[i]
        plans[i] = None
        target = total if i == 0 else part
        # The groups' sums are counted in an eighth of the budget (:func:`_output_groups`):
        # a SYRK's buffers take what they leave of it.
        _fill_gram(target, bx, by, "trace", w, layout, symmetric, dense, None,
                   budget // 8 - held)
        # Each group's trace is divided by its own number of outputs.
        if i == 0:
            total.mul_(len(columns) / C)
        else:
            total.add_(part, alpha=len(columns) / C)
    if total is not K:
        K.copy_(total)
    return K


def _group_plans(module, params, params_y, X, Y, outputs, groups, probe, weight, layout,
                 symmetric, budget, dtype, held, graph_bytes=0) -> list:
    """:func:`_gram_blocks` of every output group, in the budget less ``held`` (the
    groups' sums); ``graph_bytes``: per row, where the groups share their forward passes
    (:func:`_kept_forward_groups`), kept in what ``budget`` leaves."""
    n = X.shape[0]
    # Each group's blocks are summed before the next group's are formed, in their place.
    reuse = ({}, {})
    plans = [_gram_blocks(module, params, params_y, X, Y, [outputs[c] for c in columns],
                          "trace", _probe_outputs(probe, columns), weight, layout, symmetric,
                          budget, dtype.itemsize, reuse, held, graph_bytes)
             for columns in groups]
    if graph_bytes:
        # Every group captures the same rows (the fewest of any group's captures: a
        # chunk of its formed blocks, or a block of its factors), each capture's forward
        # pass kept from the first group to the last. The groups' blocks of factors
        # (sized by their width) are cut alike: with blocks of other rows, a group's
        # captures would find no kept forward pass and keep their own.
        rows = min(min(bx.chunk or n, bx.slices[0].stop) for bx, *_ in plans)
        forwards: dict = {}
        for i, (bx, *_) in enumerate(plans):
            if bx.dense and len(bx) == 1:
                bx.chunk = rows  # one block of formed gradients, captured in chunks
            else:
                bx.chunk = None
                bx.slices = [slice(s, min(s + rows, n)) for s in range(0, n, rows)]
                bx.keep = len(bx) > 1  # every group's blocks fit (_fitting_groups)
            bx.forwards, bx.last = forwards, i == len(plans) - 1
    return plans


def _fill_gram(K, bx, by, mode, weight, layout, symmetric, dense, panels,
               spare: int = 0) -> None:
    """Every block pair's products into ``K``; a symmetric Gram's upper blocks mirrored.
    ``spare``: the bytes a diagonal block's SYRK may take (see :func:`_syrk_block`)."""
    full = mode == "full"
    for i in range(len(bx)):
        cx = bx[i]
        for j in range(i if symmetric else 0, len(by)):
            si, sj = bx.slices[i], by.slices[j]
            target = K[si, :, sj, :] if full else K[si, sj]
            if symmetric and i == j:
                _symmetric_block(cx.terms, mode, weight, layout, target, panels, spare)
                continue
            # Formed blocks are costly to recompute: the next row block is held from its
            # first use as a column block.
            cy = by.hold(j) if symmetric and dense and j == i + 1 else by[j]
            block = target if panels is None else panels.get(target.shape)
            _gram_into(block, _folded(cx.terms, weight), _folded(cy.terms, weight), mode,
                       weight, layout)
            if block is not target:
                target.copy_(block)
            if symmetric:
                if full:
                    K[sj, :, si, :] = block.permute(2, 3, 0, 1)
                else:
                    K[sj, si] = block.T


@_holds_module
@_consistent_routing
def tangent_gram_diag(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    X: torch.Tensor,
    *,
    output: str | int = "trace",
    diag_weight: torch.Tensor | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    exclude: frozenset[str] = frozenset(),
    check_hidden: bool = True,
) -> torch.Tensor:
    """Diagonal ``K(x, x)`` of :func:`tangent_gram`, without the Gram.

    Unlike the off-diagonal entries, the diagonal keeps its factorised form with ``D``:
    ``sum_oi delta_o^2 D_oi a_i^2 = delta^2 . (D a^2)``, one small GEMM per layer.
    exclude : frozenset of str, default=frozenset()
        Parameters whose layers must use the generic fallback. Layers with a parameter
        read outside their own call are found by every capture and added to these.
    check_hidden : bool, default=True
        Run the autograd check of a few samples (:func:`._capture.check_rows`) for
        reads that torch functions do not see (TorchScript, C++ extensions) and for a
        forward pass that reorders the samples before a rule layer. A caller evaluating
        many points of one path runs it once with :func:`hidden_reads` and passes the
        result as ``exclude``.

    Returns
    -------
    k : torch.Tensor of shape (n_samples,), or (n_samples, C, C) for ``output="full"``
    """
    params, outputs, mode, probe = _prepare(module, params, X, output, memory_budget, exclude,
                                            check_hidden)
    dtype = value_dtype(params, X)
    weight = _check_weight(diag_weight, params, dtype, X.device)
    layout = _layout(params)
    n_out = len(outputs)
    itemsize = dtype.itemsize
    routes = {t.inputs[0][0]: _diag_route(t, mode, weight is not None) for t in probe.terms}
    extra = max([_dense_bytes(t, itemsize) * 2 if routes[t.inputs[0][0]] == "dense"
                 else pair_diag_bytes(t, itemsize) if routes[t.inputs[0][0]] == "pair" else 0
                 for t in probe.terms], default=0)
    size = _block_size(X.shape[0], memory_budget, probe.capture_bytes() + extra)
    blocks = _Blocks(module, params, X, size, outputs, memory_budget, keep=False,
                     exclude=probe.exclude)
    shape = (X.shape[0], n_out, n_out) if mode == "full" else (X.shape[0],)
    out = torch.zeros(shape, dtype=dtype, device=X.device)
    for i in range(len(blocks)):
        sl = blocks.slices[i]
        for term in blocks[i].terms:
            route = routes[term.inputs[0][0]]
            if route == "pair":
                left = None
                if weight is not None:  # an index term (the others are formed)
                    left = index_scaled(term, weight[slice(*_span(layout[term.inputs[0][0]]))])
                out[sl] += pair_diag(term, mode, left)
            elif route == "dense":
                for name, a in term.inputs:
                    g = dense_grad(term, a)
                    gw = g if weight is None else g * weight[slice(*_span(layout[name]))]
                    out[sl] += (torch.einsum("ncr,ndr->ncd", gw, g) if mode == "full"
                                else (gw * g).sum((1, 2)) / n_out)
            else:
                _rank_one_diag(out[sl], term, mode, weight, layout, n_out)
    return out


def _span(start_size):
    start, size = start_size
    return start, start + size


def _diag_route(term: Term, mode: str, weighted: bool) -> str:
    """"rank1" (the factorised diagonal), "pair" or "dense" for one term's K(x, x)."""
    factored = [a for _, a in term.inputs if a is not None]
    if not factored or rank_one(term) and not (weighted and term.transposed):
        return "rank1"
    if weighted and term.rows is None:
        return "dense"
    _, C, S, p = term.delta.shape
    numel = sum(param_numel(term, a) for a in factored)
    c2 = C * C if mode == "full" else C
    # pair: A = a a^T (S^2 q), E = A delta (S^2 C p), then delta . E (c2 S p / C);
    # dense: the blocks (S C numel), then their squares (c2 numel). An index term's
    # A is one comparison per pair, and its blocks are zeroed, then scattered into.
    if term.rows is not None:
        q, form = len(factored), C * (numel + S * p)
    else:
        q, form = sum(a.shape[2] for a in factored), S * C * numel
    pair = S * S * (q + C * p) + c2 * S * p
    dense = form + c2 * numel
    return "dense" if dense < pair else "pair"


def _rank_one_diag(out, term, mode, weight, layout, n_out) -> None:
    """One position: ``sum_oi delta_o^2 D_oi a_i^2 = delta^2 . (D a^2)``, added to ``out``."""
    d = term.delta[:, :, 0]
    if weight is None:
        ga = sum((a[:, 0] * a[:, 0]).sum(1) if a is not None else 1.0 for _, a in term.inputs)
        if mode == "full":
            if isinstance(ga, torch.Tensor):
                ga = ga.reshape(-1, 1, 1)
            out += torch.einsum("ncp,ndp->ncd", d, d) * ga
        else:
            out += (d * d).sum((1, 2)) * ga / n_out
        return
    for name, a in term.inputs:
        start, numel = layout[name]
        w = weight[start : start + numel].reshape(d.shape[2], -1)
        s = w[:, 0].expand(d.shape[0], -1) if a is None else (a[:, 0] * a[:, 0]) @ w.T
        if mode == "full":
            out += torch.einsum("ncp,ndp,np->ncd", d, d, s)
        else:
            out += (d * d * s.unsqueeze(1)).sum((1, 2)) / n_out


@_holds_module
def contracted_features(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    X: torch.Tensor,
    weights: torch.Tensor,
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> torch.Tensor:
    """``d (w_n . f(x_n; theta)) / d theta`` for every row, (n_samples, P) in flat order.

    One capture whose backward pass is seeded with ``weights`` (n_samples, n_outputs),
    instead of the ``C`` Jacobian rows :func:`tangent_features` forms; the hidden reads
    are checked on the first rows as there. The rows of ``X`` are captured at once: for
    callers whose blocks of rows are already sized to their memory budget.
    """
    params, outputs, _, probe = _prepare(module, params, X, "trace", memory_budget)
    cap = capture(module, params, X, outputs, memory_budget=memory_budget,
                  exclude=probe.exclude, weights=weights, index=True)
    layout = _layout(params)
    n_params = sum(size for _, size in layout.values())
    out = torch.empty((X.shape[0], 1, n_params), dtype=value_dtype(params, X),
                      device=X.device)
    return dense_rows(cap.terms, layout, out)[:, 0]


@_holds_module
@_consistent_routing
def tangent_features(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    X: torch.Tensor,
    *,
    output: str | int = "trace",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    exclude: frozenset[str] = frozenset(),
    check_hidden: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense tangent features (per-sample Jacobians), columns in flat (trajectory) order.
    exclude : frozenset of str, default=frozenset()
        Parameters whose layers must use the generic fallback. Layers with a parameter
        read outside their own call are found by every capture and added to these.
    check_hidden : bool, default=True
        Run the autograd check of a few samples (:func:`._capture.check_rows`) for
        reads that torch functions do not see (TorchScript, C++ extensions) and for a
        forward pass that reorders the samples before a rule layer. A caller evaluating
        many points of one path runs it once with :func:`hidden_reads` and passes the
        result as ``exclude``.
    out : torch.Tensor of shape (n_samples, n_outputs_used, P), default=None
        Buffer for the ``(n, C, P)`` Jacobian (``C`` the outputs used): callers that need
        features at many points reuse one buffer instead of faulting in fresh memory.
        The returned tensor is ``out`` itself (``"full"``), a view of it (one output),
        or, for ``"trace"`` with ``C > 1``, a new tensor scaled by ``1 / sqrt(C)`` (``out``
        then holds the unscaled Jacobian).

    Returns
    -------
    phi : torch.Tensor
        ``(n_samples, P)`` for one output (``C == 1`` or ``output=int``);
        ``(n_samples, C * P)`` for ``output="trace"`` with ``C > 1``: the row-major
        flattened Jacobian divided by ``sqrt(C)``, so that ``phi phi^T`` is the trace
        kernel; ``(n_samples, C, P)`` for ``output="full"``.
    """
    params, outputs, mode, probe = _prepare(module, params, X, output, memory_budget, exclude,
                                            check_hidden)
    layout = _layout(params)
    n_params = sum(size for _, size in layout.values())
    n_out = len(outputs)
    dtype = value_dtype(params, X)
    # A term with positions forms its blocks before they are copied into phi.
    formed = max([_dense_bytes(t, dtype.itemsize) for t in probe.terms if not rank_one(t)
                  or t.transposed], default=0)
    per_row = probe.capture_bytes() + n_out * n_params * dtype.itemsize + formed
    size = _block_size(X.shape[0], memory_budget, per_row)
    blocks = _Blocks(module, params, X, size, outputs, memory_budget, keep=False,
                     exclude=probe.exclude)
    shape = (X.shape[0], n_out, n_params)
    if out is None:
        phi = torch.empty(shape, dtype=dtype, device=X.device)
    elif out.shape != shape or out.dtype != dtype or out.device != X.device:
        raise ValueError(f"out must be a {dtype} tensor of shape {shape} on {X.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}.")
    else:
        phi = out
    for i in range(len(blocks)):
        dense_rows(blocks[i].terms, layout, phi[blocks.slices[i]])
    if mode == "full":
        return phi
    if n_out == 1:
        return phi[:, 0, :]
    if out is None:  # scaled in place: a scaled copy beside it doubled the call's peak
        return phi.div_(math.sqrt(n_out)).reshape(X.shape[0], n_out * n_params)
    return phi.reshape(X.shape[0], n_out * n_params) / math.sqrt(n_out)
