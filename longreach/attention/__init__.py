"""Attention: the contract every method meets, the shared toolkit, and one folder per method.

  backend.py    the AttentionBackend contract and the per-step AttentionMetadata
  registry.py   method name -> backend class (one line per method), MethodSpec (`METHOD[:PRESET]`)
  index.py      the sparse index formats (SparseIndex, RangeIndex, QueryBlocks): selection -> execution
  executor.py   PyTorch references of block-sparse and range attention (the kernels live in kernels/)
  dense.py      the dense backend, and DenseFallback: when a method attends densely instead
  presets.py    config resolution: a method's preset plus --attention-config overrides
  compose.py    a prefill method and a decode method as one backend (--decode-attention)
  sparse/       the toolkit of the top-k selection methods: SparseConfig, SelectionMethod, SparseBackend and its
                GraphDecoder (the decode step as CUDA-graph variants)
  infinitehip/ hip/ quest/ streaming/ minference/ psa/ cascading/
                one folder per method: config.py (its config dataclass, presets and what each is for), method.py
                (the algorithm apart from the engine, with the decisions on what its paper leaves open), backend.py
                (its AttentionBackend), and what is its own alone (infinitehip: boxes.py; minference: index.py,
                search.py, patterns/; cascading: rings.py, plan.py, attend.py). Its kernels stay in kernels/, the leaf
                package every layer may import.

Why `attention/<method>/` and not `attention/methods/<method>/`: a method's import path stays what it was as a module
(`longreach.attention.infinitehip`, whose __init__ exports the method's public names), the registry names
`<method>.backend`, and a reader finds a method one level down from the contract it meets. Adding a method is a new
folder plus one line in registry.py (or one `register_backend` call from outside the package).
"""
