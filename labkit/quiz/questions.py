"""Multiple-choice questions for certification practice, as plain data.

The bank prepares for the NVIDIA-Certified Professional: Generative AI LLMs exam, on the topics of the labs.

`CHOICE_QUESTIONS` is a list of dicts, one per question, with these keys:

* ``id``: unique, kebab-case, starting with its topic (``"memory-zero-bytes"``);
* ``topic``: one of ``labkit.quiz.bank.TOPICS`` (cluster, parallelism, memory, precision, communication,
  pipeline, profiling);
* ``text``: the question;
* ``choices``: 3 to 5 answers, exactly one of them correct, never "all of the above";
* ``answer``: the index of the correct choice in ``choices``;
* ``explanation``: one or two sentences saying why. Where a fact or figure comes from a paper or a
  document, the explanation names it (for example "Narayanan et al. 2021, section 2.2.1" or
  "PyTorch CUDA semantics docs");
* ``reference``: the stem of the lab notebook that teaches it (``"02_oom_batch"`` for
  ``solutions/02_oom_batch.ipynb``);
* ``section``: the start of a markdown heading in that notebook, as written after the leading
  ``#``s and one space (``"3 · Fix 1"`` for ``## 3 · Fix 1: gradient accumulation, ...``).

Every question is about what holds on real GPUs (NCCL, CUDA, PyTorch), not about the emulated cluster's
own modelling choices. Arithmetic questions (bandwidths, bubbles, bytes) are generated elsewhere; these are
conceptual and "which fix" questions. The module imports nothing, so it can be read on its own.
"""

CHOICE_QUESTIONS: list[dict] = [
    # ----------------------------------------------------------------- cluster (lab 00)
    {
        "id": "cluster-rank",
        "topic": "cluster",
        "text": "In a typical multi-GPU PyTorch job on an NVIDIA node using the NCCL backend, what is one rank?",
        "choices": [
            "One CUDA stream inside a process that drives all the GPUs",
            "One process, which owns one GPU",
            "One node, whatever its number of GPUs",
            "One thread block of an NCCL kernel",
        ],
        "answer": 1,
        "explanation": "Each rank is one process bound to one GPU; the ranks exchange data through NCCL over NVLink, "
                       "PCIe or the network (torch.distributed docs).",
        "reference": "00_cluster_tour",
        "section": "1 · The cluster",
    },
    {
        "id": "cluster-allreduce-result",
        "topic": "cluster",
        "text": "Every rank calls torch.distributed.all_reduce(t, op=ReduceOp.SUM) on a tensor of the same shape. "
                "What does each rank hold in t afterwards?",
        "choices": [
            "The element-wise sum over all ranks, on every rank",
            "The sum on rank 0 only; the other ranks keep their own values",
            "Every rank's tensor, concatenated in rank order",
            "Its own 1/n slice of the element-wise sum",
        ],
        "answer": 0,
        "explanation": "All-reduce leaves the full reduction on every rank; the other answers describe reduce, "
                       "all-gather and reduce-scatter. It is the collective that averages gradients in data "
                       "parallelism.",
        "reference": "00_cluster_tour",
        "section": "2 · Your first all-reduce",
    },
    {
        "id": "cluster-busbw-purpose",
        "topic": "cluster",
        "text": "Why does nccl-tests report an all-reduce's bus bandwidth, algbw · 2(n-1)/n, next to its "
                "algorithm bandwidth?",
        "choices": [
            "It counts both directions of every link, so it is always twice the algorithm bandwidth",
            "It removes the latency term, showing what an infinitely large message would get",
            "It reflects each rank's link traffic, comparable with the hardware's bandwidth for any n",
            "It divides the traffic by the number of GPUs, giving the share of a single GPU",
        ],
        "answer": 2,
        "explanation": "Algorithm bandwidth (size / time) depends on n for the same hardware; the 2(n-1)/n factor "
                       "turns it into the per-rank link traffic, comparable with the link's speed "
                       "(nccl-tests PERFORMANCE.md).",
        "reference": "00_cluster_tour",
        "section": "3 · How fast is the link",
    },
    {
        "id": "cluster-factor-any-algorithm",
        "topic": "cluster",
        "text": "nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n applies to which all-reduce algorithms?",
        "choices": [
            "Only the ring algorithm; tree all-reduce needs its own, smaller factor",
            "Only in-switch reductions such as NVLink SHARP (NVLS) or InfiniBand SHARP",
            "Only when the number of ranks is a power of two, as in recursive doubling",
            "Any all-reduce built from point-to-point transfers, ring or tree",
        ],
        "answer": 3,
        "explanation": "PERFORMANCE.md derives 2(n-1)/n as what any point-to-point all-reduce must move per rank "
                       "(a reduce-scatter then an all-gather in effect); only in-network reduction moves less "
                       "(nccl-tests PERFORMANCE.md).",
        "reference": "00_cluster_tour",
        "section": "3 · How fast is the link",
    },
    {
        "id": "cluster-allgather-vs-allreduce",
        "topic": "cluster",
        "text": "Why is the bus bandwidth factor (n-1)/n for all-gather but 2(n-1)/n for all-reduce?",
        "choices": [
            "All-reduce is in effect a reduce-scatter then an all-gather, moving that share twice",
            "All-reduce sends every byte in both directions of each link at the same time",
            "All-reduce ends with a broadcast of rank 0's result, which doubles the hops",
            "NCCL compresses all-gather messages but must send all-reduce operands uncompressed",
        ],
        "answer": 0,
        "explanation": "Each rank of an all-gather must receive the (n-1)/n of the buffer it lacks; an all-reduce "
                       "must move that much once to reduce and once to share the result (nccl-tests "
                       "PERFORMANCE.md; Thakur et al. 2005).",
        "reference": "00_cluster_tour",
        "section": "Practice questions",
    },
    {
        "id": "cluster-small-messages",
        "topic": "cluster",
        "text": "An nccl-tests sweep shows all-reduce bus bandwidth far below the link's for small messages and "
                "close to its plateau for large ones. What explains the small-message end?",
        "choices": [
            "A ring all-reduce moves proportionally more bytes per rank for small buffers",
            "Each step pays a fixed latency, which dominates when there are few bytes",
            "NCCL routes small messages through host memory instead of over NVLink",
            "The GPU lowers its clocks for short kernels, slowing their transfers",
        ],
        "answer": 1,
        "explanation": "In the α-β model T = 2(n-1)(α + S/(nβ)), the latency term does not shrink with S, so small "
                       "messages are latency-bound; this is why DDP packs gradients into buckets "
                       "(Thakur et al. 2005; Li et al. 2020).",
        "reference": "00_cluster_tour",
        "section": "3 · How fast is the link",
    },
    {
        "id": "cluster-nvls-above-line-rate",
        "topic": "cluster",
        "text": "On an 8-GPU H100 node with NVSwitch, nccl-tests reports an all-reduce bus bandwidth above the "
                "per-GPU NVLink line rate. What explains it?",
        "choices": [
            "The measurement is wrong: bus bandwidth can never exceed the link's rate",
            "nccl-tests adds the bandwidth of the PCIe link to that of the NVLink ports",
            "With NVLS the switch does the reduction, so each GPU moves less data",
            "NCCL compresses bf16 buffers before sending them over NVLink",
        ],
        "answer": 2,
        "explanation": "With NVLink SHARP the switch reduces the data, which the 2(n-1)/n factor of point-to-point "
                       "algorithms does not account for, so busbw can exceed the link (nccl-tests PERFORMANCE.md; "
                       "nccl-tests issues 212 and 272).",
        "reference": "00_cluster_tour",
        "section": "3 · How fast is the link",
    },
    # ----------------------------------------------------------------- parallelism (lab 01)
    {
        "id": "parallelism-dp-more-gpus",
        "topic": "parallelism",
        "text": "A model's weights, gradients and Adam states alone exceed one GPU's memory. What does adding "
                "more GPUs to plain data parallelism (DDP) do for the memory per GPU?",
        "choices": [
            "It divides the model states by the number of GPUs, as DDP shards them",
            "It fixes the problem once the per-GPU share of the batch is small enough",
            "It shards the gradients but not the weights, which is usually enough",
            "Nothing for the model states: every replica still holds all of them",
        ],
        "answer": 3,
        "explanation": "Data parallelism replicates the whole model state on every rank, so more GPUs add copies, not "
                       "room; shard the states (ZeRO, FSDP) or split the model (tensor or pipeline parallelism) "
                       "(Rajbhandari et al. 2020).",
        "reference": "01_parallelism_choice",
        "section": "1 · Mistake one",
    },
    {
        "id": "parallelism-second-step-oom",
        "topic": "parallelism",
        "text": "A data-parallel job with torch.optim.Adam completes its first training step and runs out of "
                "memory in the second. What is the most likely reason?",
        "choices": [
            "Adam creates its two moments in the first optimizer.step(); the second step holds them too",
            "The caching allocator keeps the first step's activations cached and never reuses them",
            "DDP rebuilds its gradient buckets after the first iteration and keeps both copies",
            "The learning-rate scheduler allocates a copy of the weights at its first step",
        ],
        "answer": 0,
        "explanation": "PyTorch optimizers create their state lazily at the first step, so the peak of the second step "
                       "is the first one with all model states alive (torch/optim/adam.py creates exp_avg and "
                       "exp_avg_sq when a parameter's state is empty).",
        "reference": "01_parallelism_choice",
        "section": "1 · Mistake one",
    },
    {
        "id": "parallelism-tp-allreduce-count",
        "topic": "parallelism",
        "text": "With Megatron-LM tensor parallelism and no activation recomputation, how many all-reduces does "
                "one transformer block need per micro-batch, forward and backward together?",
        "choices": [
            "One, after the MLP's second matrix",
            "Two: one in forward and one in backward",
            "Four: two in forward and two in backward",
            "One per weight matrix in forward, and as many in backward",
        ],
        "answer": 2,
        "explanation": "The g operator all-reduces in forward after attention and after the MLP, and the f operator "
                       "all-reduces the input gradients in backward, four in all (Shoeybi et al. 2019, "
                       "section 3).",
        "reference": "01_parallelism_choice",
        "section": "2 · Mistake two",
    },
    {
        "id": "parallelism-column-then-row",
        "topic": "parallelism",
        "text": "Megatron-LM splits the first matrix of the MLP by columns and the second by rows. What does "
                "that choice buy?",
        "choices": [
            "Column-split matrices map better onto tensor cores than row-split ones",
            "The GELU runs on local slices, so the MLP needs one all-reduce in forward",
            "Each rank stores half as many weights as it would with two row splits",
            "The all-reduce moves before the GELU, where the activations are smaller",
        ],
        "answer": 1,
        "explanation": "Splitting the first GEMM by columns gives each rank complete output channels for the "
                       "element-wise nonlinearity; the row-split second GEMM then needs one all-reduce of its "
                       "partial sums (Shoeybi et al. 2019, section 3).",
        "reference": "01_parallelism_choice",
        "section": "2 · Mistake two",
    },
    {
        "id": "parallelism-tp-across-nodes",
        "topic": "parallelism",
        "text": "Why is tensor parallelism over all 8 GPUs of two 4-GPU nodes a costly layout?",
        "choices": [
            "Every block's all-reduces cross the slow inter-node link, on the critical path",
            "Each GPU then holds a full copy of the weights, as in data parallelism",
            "The pipeline bubble grows with every node the tensor-parallel group spans",
            "NCCL cannot run tensor-parallel groups across nodes, so it falls back to gloo",
        ],
        "answer": 0,
        "explanation": "Tensor-parallel all-reduces happen inside every block and nothing can run while a block waits "
                       "for its sum, so a link about an order of magnitude slower than NVLink slows every layer "
                       "(Narayanan et al. 2021, section 3.2).",
        "reference": "01_parallelism_choice",
        "section": "2 · Mistake two",
    },
    {
        "id": "parallelism-megatron-rule",
        "topic": "parallelism",
        "text": "A GPT model no longer fits one 8-GPU NVLink server. Following Narayanan et al. (2021), how do you "
                "combine the parallelisms?",
        "choices": [
            "Tensor parallel across all servers, data parallel within each server",
            "Pipeline parallel within each server, tensor parallel across servers",
            "Data parallel alone over all servers, with a micro-batch small enough to fit",
            "Tensor parallel of 8 within each server, pipeline across servers",
        ],
        "answer": 3,
        "explanation": "Tensor parallelism should generally be used up to degree g on g-GPU servers, and pipeline "
                       "parallelism to scale across servers, since pipelines send only boundary activations "
                       "(Narayanan et al. 2021, section 3.2).",
        "reference": "01_parallelism_choice",
        "section": "6 · At scale",
    },
    {
        "id": "parallelism-rank-order",
        "topic": "parallelism",
        "text": "Megatron-LM numbers ranks with tensor parallelism fastest, so a tensor-parallel group is "
                "consecutive ranks. On 8-GPU nodes with tp = 8, what does that ordering achieve?",
        "choices": [
            "Each data-parallel group stays inside one node, so gradient all-reduces use NVLink",
            "TP groups stay on NVLink in one node; data and pipeline groups cross nodes",
            "Each tensor-parallel group spans every node, spreading the network load evenly",
            "Pipeline neighbours share a node, so their activation transfers use NVLink",
        ],
        "answer": 1,
        "explanation": "Consecutive ranks share a node, so the most communication-heavy groups (tensor parallel) get "
                       "the fastest links (Megatron-LM's rank order; Narayanan et al. 2021).",
        "reference": "01_parallelism_choice",
        "section": "3 · The fix",
    },
    {
        "id": "parallelism-pp-or-dp-across-nodes",
        "topic": "parallelism",
        "text": "The model fits one node with tensor parallelism, and you have several nodes. When is pipeline "
                "parallelism across the nodes the better choice than data parallelism across them?",
        "choices": [
            "Always: data parallelism has a bubble of its own, which pipelines avoid",
            "When the global batch is too small to split into enough micro-batches to fill the pipeline across nodes",
            "When the gradient all-reduce over the slow link costs more than the bubble and activation sends",
            "When the model has fewer layers than there are nodes, so each node gets whole layers",
        ],
        "answer": 2,
        "explanation": "Across the slow link, data parallelism moves the whole gradient every step while a pipeline "
                       "moves one activation per micro-batch but idles in its bubble; the cheaper one wins. Once "
                       "the model fits, Narayanan et al. (2021, Takeaway #2) scale further with data parallelism.",
        "reference": "01_parallelism_choice",
        "section": "3 · The fix",
    },
    # ----------------------------------------------------------------- memory (lab 02)
    {
        "id": "memory-zero-bytes",
        "topic": "memory",
        "text": "With mixed-precision Adam, how many bytes of model states does each parameter need, in the "
                "ZeRO paper's count?",
        "choices": ["4", "8", "12", "16"],
        "answer": 3,
        "explanation": "fp16 weights (2) + fp16 gradients (2) + fp32 master weights, momentum and variance (12) = 16 "
                       "(Rajbhandari et al. 2020, section 3.1).",
        "reference": "02_oom_batch",
        "section": "2.1 Model states",
    },
    {
        "id": "memory-18-bytes",
        "topic": "memory",
        "text": "ZeRO counts mixed-precision Adam as 16 bytes per parameter, yet some sources say 18. What accounts "
                "for the difference?",
        "choices": [
            "The 18-byte count keeps the gradients in fp32 (2 + 4 + 12)",
            "The 18-byte count includes the activations of one sequence",
            "The 18-byte count is for an optimizer with a third moment",
            "The 18-byte count stores the fp16 weights twice, once per stream",
        ],
        "answer": 0,
        "explanation": "Keeping or accumulating gradients in fp32 adds 2 bytes to ZeRO's 2 + 2 + 12, as in "
                       "Megatron-LM with fp32 gradient accumulation and Hugging Face's model memory anatomy page; "
                       "the optimizer is the same.",
        "reference": "02_oom_batch",
        "section": "2.1 Model states",
    },
    {
        "id": "memory-what-scales-with-batch",
        "topic": "memory",
        "text": "Which part of a training step's memory grows in proportion to the micro-batch size?",
        "choices": [
            "The gradients",
            "The activations saved for backward",
            "Adam's momentum and variance",
            "The fp32 master copy of the weights",
        ],
        "answer": 1,
        "explanation": "Saved activations scale with s·b·h per layer (Korthikanti et al. 2022, section 4.1); the "
                       "model states depend only on the parameter count.",
        "reference": "02_oom_batch",
        "section": "2.2 Activations",
    },
    {
        "id": "memory-states-exceed-card",
        "topic": "memory",
        "text": "A model's states at 16 bytes per parameter exceed one GPU's memory even at micro-batch 1. Which "
                "fix works?",
        "choices": [
            "Gradient accumulation, running several micro-batches of one sequence per optimizer step",
            "Activation checkpointing of every block, recomputing it in backward",
            "Shard the states (ZeRO, FSDP) or split the model (tensor or pipeline parallel)",
            "bf16 autocast, which halves the bytes of the weights and of Adam's states",
        ],
        "answer": 2,
        "explanation": "Accumulation, checkpointing and autocast act on activations only; the states must be divided "
                       "across GPUs (Rajbhandari et al. 2020).",
        "reference": "02_oom_batch",
        "section": "2.3 A model too large",
    },
    {
        "id": "memory-zero-stage1",
        "topic": "memory",
        "text": "What does ZeRO stage 1 partition across the data-parallel ranks?",
        "choices": [
            "The optimizer states only: fp32 master weights, momentum and variance",
            "The gradients only, which are reduce-scattered instead of all-reduced",
            "The parameters, gradients and optimizer states, gathering weights when needed",
            "The activations of each micro-batch, split along the sequence",
        ],
        "answer": 0,
        "explanation": "Stage 1 (P_os) shards the optimizer states, stage 2 adds the gradients and stage 3 (like "
                       "FSDP's full sharding) the parameters too (Rajbhandari et al. 2020, Figure 1 and section 5).",
        "reference": "02_oom_batch",
        "section": "2.3 A model too large",
    },
    {
        "id": "memory-accumulation",
        "topic": "memory",
        "text": "The training recipe fixes the global batch, but its activations do not fit. Which change keeps "
                "the same gradient per optimizer step?",
        "choices": [
            "Halve the global batch and scale the learning rate so the update stays the same",
            "Gradient accumulation: several micro-batches per step, each loss divided by their count",
            "Replace Adam with SGD, which frees the optimizer states' memory for the activations",
            "Raise DDP's bucket_cap_mb so that fewer, larger gradient buckets are kept in memory",
        ],
        "answer": 1,
        "explanation": "Summing the gradients of the scaled micro-batch losses gives the mean gradient over the whole "
                       "batch, up to rounding, while memory holds one micro-batch's activations at a time.",
        "reference": "02_oom_batch",
        "section": "3 · Fix 1",
    },
    {
        "id": "memory-checkpointing-cost",
        "topic": "memory",
        "text": "What does full activation checkpointing (recomputing each block during backward) cost in exchange "
                "for its memory saving?",
        "choices": [
            "Lower precision of the gradients, since recomputed activations are rounded",
            "An extra all-reduce per block to gather the recomputed activations",
            "A smaller effective batch size, since checkpoints hold fewer sequences",
            "One extra forward of each block in backward, about a third more compute",
        ],
        "answer": 3,
        "explanation": "Only each block's input is kept and the block is recomputed in backward (Chen et al. 2016); "
                       "forward is about 2 of the 6 FLOP per parameter and token of a training step, so about 33 % "
                       "more (Kaplan et al. 2020).",
        "reference": "02_oom_batch",
        "section": "4 · Fix 2",
    },
    {
        "id": "memory-oom-retry",
        "topic": "memory",
        "text": "A batch-size search catches torch.OutOfMemoryError and retries with a smaller batch. Why should "
                "it free memory and retry only after leaving the except block?",
        "choices": [
            "CUDA rejects every new allocation while a Python exception is being handled",
            "torch.cuda.empty_cache() raises an error when called inside an except block",
            "The exception's traceback keeps the failed step's frames and tensors alive",
            "The caching allocator stays disabled until the exception object is deleted",
        ],
        "answer": 2,
        "explanation": "While the exception is alive its traceback pins the failed step's local variables, so their "
                       "memory cannot be freed; the PyTorch FAQ advises moving recovery code outside the except "
                       "clause (PyTorch FAQ, out of memory).",
        "reference": "02_oom_batch",
        "section": "5 · Fix 3",
    },
    # ----------------------------------------------------------------- precision (lab 02)
    {
        "id": "precision-autocast-states",
        "topic": "precision",
        "text": "You enable bf16 torch.autocast on a model whose parameters are fp32 and train it with Adam. What "
                "happens to the parameters, gradients and Adam states?",
        "choices": [
            "They stay fp32; only activations saved by autocast ops shrink",
            "They are all halved to 2 bytes per value, as is every activation",
            "The parameters become bf16, and the Adam states stay in fp32",
            "The gradients become bf16, and the parameters stay in fp32",
        ],
        "answer": 0,
        "explanation": "Autocast casts inputs of eligible ops on the fly and leaves the parameters (and so their "
                       "gradients and optimizer states) in their own dtype (PyTorch AMP docs; Micikevicius et al. "
                       "2018).",
        "reference": "02_oom_batch",
        "section": "4 · Fix 2",
    },
    {
        "id": "precision-why-scaler",
        "topic": "precision",
        "text": "Why does FP16 mixed-precision training need a loss scaler while bf16 training does not?",
        "choices": [
            "FP16 has fewer mantissa bits than bf16, so its gradients need rescaling",
            "FP16's 5 exponent bits let small gradients underflow; bf16 has fp32's range",
            "bf16 tensor cores apply the loss scale in hardware, FP16 ones do not",
            "NCCL cannot all-reduce FP16 gradients unless they are scaled first",
        ],
        "answer": 1,
        "explanation": "FP16's smallest normal value is about 6e-5, so scaling the loss shifts gradients into its "
                       "range (Micikevicius et al. 2018, section 3.2); bf16 keeps fp32's exponent range "
                       "(Kalamkar et al. 2019); FP16 in fact has more mantissa bits (10) than bf16 (7).",
        "reference": "02_oom_batch",
        "section": "FP16 instead of bf16",
    },
    {
        "id": "precision-scaler-overflow",
        "topic": "precision",
        "text": "With torch.amp.GradScaler, what happens on a step whose gradients contain inf or NaN?",
        "choices": [
            "The gradients are clipped to FP16's maximum and the step is applied",
            "Training stops with an error naming the overflowing parameter",
            "The scale is doubled and backward is run again on the same batch",
            "The optimizer step is skipped and the scale is lowered",
        ],
        "answer": 3,
        "explanation": "An overflowed step is skipped and the scale multiplied by backoff_factor (0.5 by default); "
                       "after growth_interval clean steps it grows again (PyTorch AMP docs, gradient scaling).",
        "reference": "02_oom_batch",
        "section": "FP16 instead of bf16",
    },
    {
        "id": "precision-hardware-choice",
        "topic": "precision",
        "text": "You train on a mixed fleet of V100 and H100 GPUs. Which 16-bit format suits each?",
        "choices": [
            "bf16 on both, since it needs no scaler and V100 emulates it at full speed",
            "FP16 with a GradScaler on both, since H100 runs FP16 matmuls faster than bf16",
            "FP16 with a GradScaler on V100 (no bf16 tensor cores), bf16 on H100",
            "fp32 on V100, since its tensor cores do not support 16-bit formats",
        ],
        "answer": 2,
        "explanation": "bf16 tensor-core math arrived with Ampere (A100) and is on Hopper; Volta supports FP16 tensor "
                       "cores only, so it uses FP16 with loss scaling (NVIDIA A100 architecture whitepaper; PyTorch "
                       "AMP docs).",
        "reference": "02_oom_batch",
        "section": "FP16 instead of bf16",
    },
    {
        "id": "precision-empty-cache",
        "topic": "precision",
        "text": "An OOM error says several GiB are \"reserved by PyTorch but unallocated\" for a 1 GiB request. "
                "Why does torch.cuda.empty_cache() not fix it?",
        "choices": [
            "It only frees entirely free segments; the free space is in segments with live blocks",
            "It only releases memory cached for the default CUDA stream, not for side streams",
            "The reserved memory belongs to NCCL's buffers, which empty_cache() cannot touch",
            "It would free live tensors too, so PyTorch ignores it while training runs",
        ],
        "answer": 0,
        "explanation": "The caching allocator can return a segment to the driver only when none of its blocks is in "
                       "use, so fragmented segments stay reserved (PyTorch CUDA semantics docs, memory "
                       "management).",
        "reference": "02_oom_batch",
        "section": "7 · Out of memory with memory free",
    },
    {
        "id": "precision-expandable-segments",
        "topic": "precision",
        "text": "Which setting lets PyTorch's CUDA caching allocator grow one virtual memory range per pool and "
                "unmap free pages inside it, reducing fragmentation when allocation sizes vary?",
        "choices": [
            "CUDA_LAUNCH_BLOCKING=1",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6",
            "PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:4",
        ],
        "answer": 1,
        "explanation": "Expandable segments map memory into a growing range instead of fixed cudaMalloc segments, so "
                       "holes can be reclaimed (PyTorch CUDA semantics docs, optimizing memory usage with "
                       "PYTORCH_CUDA_ALLOC_CONF).",
        "reference": "02_oom_batch",
        "section": "7 · Out of memory with memory free",
    },
    {
        "id": "precision-max-split-size",
        "topic": "precision",
        "text": "What does the allocator option max_split_size_mb change?",
        "choices": [
            "It caps the size of any single tensor the allocator will serve",
            "It sets the size of the segments that small allocations are packed into",
            "It limits the share of the GPU's memory that PyTorch may reserve",
            "Cached blocks above that size are not split to serve smaller requests",
        ],
        "answer": 3,
        "explanation": "Blocks above the limit are kept whole, and can be released when memory runs short, instead of "
                       "being carved into pieces that fragment them (PyTorch CUDA semantics docs, "
                       "PYTORCH_CUDA_ALLOC_CONF).",
        "reference": "02_oom_batch",
        "section": "7 · Out of memory with memory free",
    },
    {
        "id": "precision-fragmentation-sign",
        "topic": "precision",
        "text": "An allocation fails on a GPU. Which observation (torch.cuda functions) points to fragmentation rather "
                "than a model that simply needs more memory?",
        "choices": [
            "memory_allocated() growing by the same amount every step",
            "nvidia-smi showing 100 % GPU utilisation during the step",
            "memory_reserved() far above memory_allocated() at the failure",
            "max_memory_allocated() equal to the card's whole capacity",
        ],
        "answer": 2,
        "explanation": "Reserved but unallocated memory is cached free space too scattered to serve the request; "
                       "memory_stats() and a memory snapshot show the holes (PyTorch docs, Understanding CUDA "
                       "Memory Usage). Steady growth of allocated memory would be a leak instead.",
        "reference": "02_oom_batch",
        "section": "7 · Out of memory with memory free",
    },
    # ----------------------------------------------------------------- communication (labs 02 and 03)
    {
        "id": "communication-naive-loop",
        "topic": "communication",
        "text": "A hand-written loop calls dist.all_reduce(p.grad) for every parameter after loss.backward() "
                "returns. Compared with DDP, what does it cost?",
        "choices": [
            "Nothing extra: the same bytes cross the link, only in a different order",
            "About compute plus communication: no overlap, and a fixed cost per tensor",
            "Wrong gradients, since the tensors are reduced one at a time after backward",
            "Less time, since it skips DDP's copies of the gradients into buckets",
        ],
        "answer": 1,
        "explanation": "The gradients are correct but the all-reduces start only after backward and come one per "
                       "tensor, each paying its latency; DDP buckets them and overlaps them with backward "
                       "(Li et al. 2020, section 3.2).",
        "reference": "03_unoverlapped_comms",
        "section": "3 · Why: two separate costs",
    },
    {
        "id": "communication-overlap-limit",
        "topic": "communication",
        "text": "A data-parallel step has compute time T_compute and gradient communication time T_comm. What is "
                "the best step time that overlapping communication with backward can approach?",
        "choices": [
            "T_compute + T_comm",
            "T_compute · T_comm / (T_compute + T_comm)",
            "max(T_compute, T_comm)",
            "min(T_compute, T_comm)",
        ],
        "answer": 2,
        "explanation": "Fully overlapped, the longer of the two hides the shorter; a little always stays exposed "
                       "because the last bucket is ready only when backward ends.",
        "reference": "03_unoverlapped_comms",
        "section": "3 · Why: two separate costs",
    },
    {
        "id": "communication-bucket-order",
        "topic": "communication",
        "text": "On one rank a later gradient bucket fills before an earlier one. Why does DDP still launch the "
                "buckets' all-reduces strictly in index order?",
        "choices": [
            "Collectives match by issue order; different orders can hang or mix buffers",
            "NCCL requires buffers to be launched in increasing size on every rank",
            "The optimizer needs the averaged gradients back in parameter order",
            "Launching in index order maximises the overlap with backward on each rank",
        ],
        "answer": 0,
        "explanation": "A mismatched order \"can lead to wrong results or DDP backward hang\" (PyTorch DDP design "
                       "note; Li et al. 2020).",
        "reference": "03_unoverlapped_comms",
        "section": "3 · Why: two separate costs",
    },
    {
        "id": "communication-when-ddp-reduces",
        "topic": "communication",
        "text": "When does torch.nn.parallel.DistributedDataParallel all-reduce the gradients?",
        "choices": [
            "During loss.backward(), each bucket once its gradients are ready",
            "Inside optimizer.step(), just before the parameters are updated",
            "At the start of the next forward pass, while inputs are loading",
            "When dist.barrier() is called at the end of the training step",
        ],
        "answer": 0,
        "explanation": "DDP's autograd hooks launch each bucket's all-reduce during backward and wait for all of them "
                       "before backward returns (Li et al. 2020, section 3.2; PyTorch DDP design note).",
        "reference": "03_unoverlapped_comms",
        "section": "5 · Re-measure",
    },
    {
        "id": "communication-one-huge-bucket",
        "topic": "communication",
        "text": "Why can a single bucket holding all of a model's gradients be slower than a few smaller buckets?",
        "choices": [
            "NCCL cannot all-reduce buffers larger than DDP's 25 MiB default",
            "It can start only when the last gradient is ready, after backward",
            "Large buffers force NCCL onto its tree algorithm, which is slower",
            "DDP splits it back into one all-reduce per tensor before sending",
        ],
        "answer": 1,
        "explanation": "Bucket size trades per-collective cost against overlap: tiny buckets pay many fixed costs, "
                       "one huge bucket waits for the end of backward; bucket_cap_mb (25 MiB by default) is worth "
                       "tuning (PyTorch DDP docs).",
        "reference": "03_unoverlapped_comms",
        "section": "6 · How big should a bucket be?",
    },
    {
        "id": "communication-nccl-sync-return",
        "topic": "communication",
        "text": "On the NCCL backend, when does a default (async_op=False) dist.all_reduce(t) on a CUDA tensor "
                "return to Python?",
        "choices": [
            "Only after every rank has copied the result back into host memory",
            "After the GPU has finished the collective, as torch.cuda.synchronize() would",
            "Once enqueued on the GPU; later work on the current stream is ordered after it",
            "Immediately, with no ordering guarantee for later kernels that read t",
        ],
        "answer": 2,
        "explanation": "For CUDA collectives the call does not wait for the GPU to finish; operations on the same "
                       "stream see the result (torch.distributed docs, synchronous and asynchronous collective "
                       "operations).",
        "reference": "03_unoverlapped_comms",
        "section": "2 · Reproduce",
    },
    {
        "id": "communication-accumulation-without-no-sync",
        "topic": "communication",
        "text": "Gradient accumulation under DDP runs 4 micro-batches per optimizer step without no_sync(). What "
                "is the effect?",
        "choices": [
            "Gradients 4 times too large, summed once per micro-batch",
            "A hang at the second micro-batch's backward",
            "Twice the memory: one bucket set per micro-batch",
            "Correct gradients, but 4 times the all-reduces",
        ],
        "answer": 3,
        "explanation": "Averaging is linear, so averaging after each micro-step gives the same result as once, at "
                       "4x the all-reduces; no_sync() skips them until the last micro-step (PyTorch "
                       "DistributedDataParallel.no_sync docs).",
        "reference": "02_oom_batch",
        "section": "The silent mistake",
    },
    {
        "id": "communication-no-sync-forward",
        "topic": "communication",
        "text": "For the micro-steps that should not synchronise, what must run inside the ddp.no_sync() context?",
        "choices": [
            "Only optimizer.step()",
            "Both the forward pass and the backward pass",
            "Only loss.backward(); the forward can stay outside",
            "Only zero_grad()",
        ],
        "answer": 1,
        "explanation": "The PyTorch docs note that the forward pass should be included inside the context manager, or "
                       "else gradients will still be synchronized (PyTorch DistributedDataParallel.no_sync docs).",
        "reference": "02_oom_batch",
        "section": "3 · Fix 1",
    },
    # ----------------------------------------------------------------- pipeline (lab 04)
    {
        "id": "pipeline-why-across-nodes",
        "topic": "pipeline",
        "text": "Why is pipeline parallelism the usual choice across the slower links between nodes?",
        "choices": [
            "Only stage-boundary activations and their gradients cross the link",
            "Stages need no communication at all once the weights are placed",
            "It all-reduces the gradients once per step rather than once per layer",
            "Each stage compresses its activations before sending them to the next",
        ],
        "answer": 0,
        "explanation": "Point-to-point transfers of boundary activations are small next to tensor parallelism's "
                       "per-layer all-reduces or data parallelism's full-gradient all-reduce (Huang et al. 2019; "
                       "Narayanan et al. 2021).",
        "reference": "04_imbalanced_pipeline",
        "section": "1 · The experiment",
    },
    {
        "id": "pipeline-even-split-head",
        "topic": "pipeline",
        "text": "A GPT with a large vocabulary is split into pipeline stages with the same number of blocks on each, "
                "the embedding on the first stage and the LM head on the last. Which stage is slowest, and why?",
        "choices": [
            "The first: the embedding has as many parameters as the head, and a lookup per token",
            "A middle one: it both receives and sends activations every micro-batch",
            "The last: the head's d_model x vocab matmuls and the loss cost several blocks",
            "None: with equal block counts every stage costs the same per micro-batch",
        ],
        "answer": 2,
        "explanation": "The embedding is a row lookup, cheap despite its parameters, while the head is a large "
                       "matmul over every token in forward and backward, so the last stage paces the pipeline.",
        "reference": "04_imbalanced_pipeline",
        "section": "2 · Reproduce",
    },
    {
        "id": "pipeline-slowest-stage",
        "topic": "pipeline",
        "text": "In the steady state of a GPipe or 1F1B pipeline with unequal stage costs, what sets the time per "
                "micro-batch?",
        "choices": [
            "The average cost of the stages",
            "The cost of the slowest stage",
            "The cost of the first stage",
            "The sum of all the stage costs",
        ],
        "answer": 1,
        "explanation": "Every other stage waits for the slowest one once per micro-batch, so a step takes "
                       "sum(c) + (m - 1) · max(c); balancing minimises the maximum.",
        "reference": "04_imbalanced_pipeline",
        "section": "3 · Why: the slowest stage",
    },
    {
        "id": "pipeline-1f1b-vs-gpipe",
        "topic": "pipeline",
        "text": "At the same number of stages and micro-batches, what does switching from GPipe to 1F1B change?",
        "choices": [
            "No bubble: every stage is busy from the first slot",
            "Half the bubble, with the same activation memory",
            "Twice the point-to-point transfers, for a smaller bubble",
            "Lower peak activation memory, with the same bubble",
        ],
        "answer": 3,
        "explanation": "Both schedules fill and drain with p - 1 slots, so the bubble is the same; 1F1B runs each "
                       "backward as early as possible, bounding in-flight activations (Narayanan et al. 2021, "
                       "section 2.2.1).",
        "reference": "04_imbalanced_pipeline",
        "section": "7 · GPipe or 1F1B",
    },
    {
        "id": "pipeline-gpipe-in-flight",
        "topic": "pipeline",
        "text": "Under GPipe with m micro-batches on p stages, how many micro-batches' activations does the first "
                "stage hold at its peak?",
        "choices": ["1", "p - 1", "p", "All m"],
        "answer": 3,
        "explanation": "GPipe runs every forward before any backward, so the first stage keeps activations for all m "
                       "micro-batches, the whole batch whatever m is; 1F1B caps it at p (Narayanan et al. 2021, "
                       "section 2.2.1).",
        "reference": "04_imbalanced_pipeline",
        "section": "4 · Fix, part 1",
    },
    {
        "id": "pipeline-more-micro-batches",
        "topic": "pipeline",
        "text": "Under 1F1B with a fixed global batch, you raise the number of micro-batches m. What happens?",
        "choices": [
            "A smaller bubble, but smaller micro-batches that may use each GPU less well",
            "A larger bubble, since there are more micro-batch slots to fill and drain",
            "More activation memory on the first stage, growing in proportion to m",
            "No change: the bubble depends only on the number of stages p",
        ],
        "answer": 0,
        "explanation": "The bubble is (p-1)/(m+p-1) of the step, but smaller micro-batches lower per-kernel "
                       "efficiency, the trade-off Narayanan et al. (2021) weigh when choosing the micro-batch size.",
        "reference": "04_imbalanced_pipeline",
        "section": "4 · Fix, part 1",
    },
    {
        "id": "pipeline-greedy-balance",
        "topic": "pipeline",
        "text": "You split layers into stages greedily: add layers to a stage until it reaches the average cost, "
                "then start the next. What is wrong with that?",
        "choices": [
            "Nothing: greedy filling is optimal for contiguous splits of layers",
            "It reorders the layers by cost, which changes the model's output",
            "An early cut cannot be undone, so its bottleneck can exceed the optimum",
            "It is optimal but needs O(n²) time, too slow for deep models",
        ],
        "answer": 2,
        "explanation": "Minimising the most expensive stage over contiguous splits needs an exact method; a greedy "
                       "pass can overshoot on one stage and leave too little room elsewhere.",
        "reference": "04_imbalanced_pipeline",
        "section": "5 · Fix, part 2",
    },
    {
        "id": "pipeline-interleaved",
        "topic": "pipeline",
        "text": "What does the interleaved 1F1B schedule (v chunks of layers per GPU) trade?",
        "choices": [
            "A smaller bubble for v times as many point-to-point transfers",
            "Less activation memory for a larger bubble",
            "No bubble, at the cost of a copy of the weights on every GPU",
            "A smaller bubble for extra all-reduces over the data-parallel group",
        ],
        "answer": 0,
        "explanation": "Each micro-batch crosses the GPUs v times in shorter hops, so the fill and drain shrink by v, "
                       "while the number of sends grows by v (Narayanan et al. 2021, section 2.2.2).",
        "reference": "04_imbalanced_pipeline",
        "section": "8 · Interleaved 1F1B",
    },
    # ----------------------------------------------------------------- profiling (lab 05)
    {
        "id": "profiling-find-straggler",
        "topic": "profiling",
        "text": "In a synchronous data-parallel job one rank is slower than the others. Which measurement from the "
                "traces identifies it?",
        "choices": [
            "Per-rank step time: the straggler's step is clearly the longest",
            "Per-rank compute: the straggler computes most while others wait",
            "Per-rank time blocked in collectives: the straggler waits the most",
            "Per-rank peak GPU memory: the straggler allocates the most",
        ],
        "answer": 1,
        "explanation": "At every all-reduce the fast ranks wait for the slow one, so step times look alike and the "
                       "straggler is the rank that waits least; per-rank compute shows who is slow.",
        "reference": "05_unprofiled_run",
        "section": "3 · Read the traces",
    },
    {
        "id": "profiling-bounded-schedule",
        "topic": "profiling",
        "text": "Why give torch.profiler a schedule (skip, warm up, then a few active steps) rather than profiling "
                "the whole training run?",
        "choices": [
            "Without a schedule the profiler records only CPU operators, no CUDA kernels",
            "The profiler can hold only one step's events in memory at a time",
            "Warm-up steps are needed to compile the model before it can be traced",
            "Traces grow with every event and the profiler slows the job; a few steps suffice",
        ],
        "answer": 3,
        "explanation": "torch.profiler.schedule(wait, warmup, active) limits what is recorded and skips first-step "
                       "effects (PyTorch profiler docs).",
        "reference": "05_unprofiled_run",
        "section": "3 · Read the traces",
    },
    {
        "id": "profiling-item-every-step",
        "topic": "profiling",
        "text": "A training loop calls loss.item() every step for logging, and the GPUs show gaps between steps. "
                "Why?",
        "choices": [
            "It waits for all queued kernels, so the host cannot run ahead and the GPU idles",
            "Copying the value to the host saturates the PCIe link that feeds the GPU its inputs",
            "item() starts an all-reduce of the loss over all ranks each step",
            "item() turns off cuDNN autotuning for the following step's kernels",
        ],
        "answer": 0,
        "explanation": "CUDA work is asynchronous; reading a value on the host forces a synchronisation, which "
                       "Nsight Systems shows as cudaStreamSynchronize or a blocking copy (PyTorch CUDA semantics "
                       "docs, asynchronous execution).",
        "reference": "05_unprofiled_run",
        "section": "7 · On GPUs",
    },
    {
        "id": "profiling-data-loading-fix",
        "topic": "profiling",
        "text": "A trace shows 40 % of every step inside the DataLoader's __next__ on the training process's main "
                "thread. Which fix addresses it?",
        "choices": [
            "A larger DDP bucket_cap_mb, so fewer all-reduces interrupt the step",
            "bf16 autocast, so each step's forward and backward run faster",
            "DataLoader workers (num_workers > 0, pin_memory=True), or pre-tokenize ahead",
            "More pipeline stages, so each rank loads a smaller share of the data",
        ],
        "answer": 2,
        "explanation": "The time is spent preparing data on the training thread, not on the GPU; worker processes "
                       "prefetch batches in parallel (PyTorch torch.utils.data docs).",
        "reference": "05_unprofiled_run",
        "section": "5 · Fix what the trace pointed to",
    },
    {
        "id": "profiling-many-small-collectives",
        "topic": "profiling",
        "text": "A trace shows hundreds of small all-reduces per step, one after another after backward, with no "
                "compute beside them. What is the likely cause, and the fix?",
        "choices": [
            "A straggler rank; rebalance the work so every rank computes the same",
            "Per-tensor all-reduce after backward; use DDP's overlapped buckets",
            "Memory fragmentation; set expandable_segments to reuse the holes",
            "Slow data loading; add DataLoader workers so batches are ready",
        ],
        "answer": 1,
        "explanation": "Many small, exposed collectives each pay a fixed latency and overlap nothing; buckets launched "
                       "from gradient hooks fix both (Li et al. 2020).",
        "reference": "05_unprofiled_run",
        "section": "4 · Let the trace name it",
    },
    {
        "id": "profiling-blocking-logging-collective",
        "topic": "profiling",
        "text": "Every rank's trace shows it blocked early in the step, between forward and backward, on one small "
                "all-reduce. What is the likely cause?",
        "choices": [
            "DDP's gradient buckets, which are all-reduced between forward and backward",
            "The previous iteration's optimizer step, which finishes at that point",
            "A tensor-parallel all-reduce at the end of the model's last block",
            "A synchronous logging collective, such as reducing the loss to print it",
        ],
        "answer": 3,
        "explanation": "DDP's buckets run during backward; a metric reduced synchronously before backward stalls every "
                       "rank, so compute it locally or reduce it asynchronously and less often.",
        "reference": "05_unprofiled_run",
        "section": "6 · Every mistake, diagnosed",
    },
    {
        "id": "profiling-overlap-from-kernels",
        "topic": "profiling",
        "text": "Why should communication overlap on a GPU be measured from kernels (NCCL kernels against compute "
                "kernels) rather than from host-side spans such as backward?",
        "choices": [
            "Host spans only time the enqueueing, so they can overstate what ran concurrently",
            "Host spans are not recorded at all for jobs that use several GPUs",
            "Kernel timestamps use the CPU clock, which is more precise than spans",
            "NCCL collectives leave no host-side spans for the profiler to compare",
        ],
        "answer": 0,
        "explanation": "Because CUDA launches are asynchronous, a host span ends long before its kernels do; only the "
                       "device timeline says what actually ran at the same time (PyTorch CUDA semantics docs, "
                       "asynchronous execution).",
        "reference": "05_unprofiled_run",
        "section": "3 · Read the traces",
    },
    {
        "id": "profiling-nvtx-ranges",
        "topic": "profiling",
        "text": "How do you make training phases such as data loading appear as named ranges next to the CUDA "
                "kernels and NCCL calls in Nsight Systems?",
        "choices": [
            "CUDA_LAUNCH_BLOCKING=1, so each phase's kernels line up with its code",
            "NCCL_DEBUG=INFO, which logs every phase next to the NCCL calls",
            "NVTX ranges (torch.cuda.nvtx.range_push/pop), traced with nsys -t cuda,nvtx",
            "torch.cuda.synchronize() at the start and end of every phase",
        ],
        "answer": 2,
        "explanation": "NVTX annotations are recorded by Nsight Systems when NVTX tracing is on, and nsys stats "
                       "--report nvtx_sum summarises them (Nsight Systems User Guide).",
        "reference": "05_unprofiled_run",
        "section": "7 · On GPUs",
    },
]
