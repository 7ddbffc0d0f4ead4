"""GGUF import, graph IR, passes, lowering to TVM and the artifact writer."""
