"""Token datasets: tokenizers, corpus preparation, and deterministic sampling.

Submodules are imported explicitly (``pretrain.data.dataset`` etc.) so that
importing the package stays cheap.
"""
