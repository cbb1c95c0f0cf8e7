"""attnlab.bench: benchmarks measured side by side with PyTorch in one run, as a library.

Each suite is ``run(XConfig(...), progress=None) -> XResult``: it measures, writes its report files
(JSON, Markdown, plots; atomically) and returns a dataclass; it never parses arguments or prints (the CLI
is ``attnlab bench SUITE``, in ``attnlab.cli``). Measuring, storing and report writing come from
:mod:`attnlab.harness`.

- :mod:`~attnlab.bench.core`: tiled / sparse / auto vs torch SDPA vs naive (``CoreConfig``).
- :mod:`~attnlab.bench.mechanisms`: every mechanism x sequence length, exponents, LRA table (``AllConfig``);
  its jobs and workers in :mod:`~attnlab.bench.all_jobs`, its report in :mod:`~attnlab.bench.all_report`.
- :mod:`~attnlab.bench.kernels`: attnlab's kernels vs SDPA and FlexAttention (``KernelsConfig``); cases in
  :mod:`~attnlab.bench.kernels_cases`, ratios and files in :mod:`~attnlab.bench.kernels_report`.
- :mod:`~attnlab.bench.layers`: self-attention vs recurrence vs convolution (``LayersConfig``).
- :mod:`~attnlab.bench.ring`: ring attention over N processes vs one (``RingConfig``).
- :mod:`~attnlab.bench.generate`: generation with vs without the KV cache (``GenerateConfig``).
- :mod:`~attnlab.bench.minilm`: MiniLM encoding, attnlab vs transformers (``MiniLMConfig``).
- :mod:`~attnlab.bench.impls`, :mod:`~attnlab.bench.fit`, :mod:`~attnlab.bench.files`: the implementations
  compared (and their fresh-process memory), fitted power laws, a small suite's JSON and figure.
"""
