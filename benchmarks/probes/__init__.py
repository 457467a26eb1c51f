"""One-off probes (measurements that answered a question once; kept runnable)."""
