"""The benchmarks' shared harness: child processes and their costs, servers, tools, photos, reports."""
