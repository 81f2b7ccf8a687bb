"""The lab: what measures and demonstrates the engine, kept apart from the engine itself.

  bench/         benchmarks (`longreach bench ...`), always with the baseline measured in the same run
  eval/          quality evaluations (`longreach eval ...`): passkey, RULER, perplexity, recall, agreement; and the
                 evaluation-only presets (eval/presets.py)
  calibrate.py   `longreach calibrate`: MInference's offline per-head pattern search
  demo.py        `longreach demo`: a number hidden past the trained context, sparse attention vs dense

The runtime (every other package of longreach) never imports this one (tests/test_import_graph.py), so that
`pip install longreach` is the engine alone; the lab's own dependencies come with the `[eval]` extra (`bench engine`'s
reference, transformers, with `[bench]`), and the CLI says so when one is missing. Importing a command module here
imports no torch (the CLI builds its parser from them).
"""
