"""The disk prefix store (tier 2): full KV blocks as safetensors blobs under a SQLite index.

- `tier`: the store as the engine sees it (continue a prefix match, load runs, persist blocks);
- `prefix_store`: one model's reads and writes, with failures turned into warnings;
- `writer`: the background thread that writes queued blocks;
- `index`, `blobs`, `files`, `pruning`: the SQLite index, the blob format, the directory, the
  LRU tail-first pruning plan;
- `maintenance`: what `pagecli cache` does (no torch needed).
"""
