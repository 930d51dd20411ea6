"""`inv bench`: the reference's benchmark protocols (bench/*.toml) against live vLLM servers.

protocols (the data model), runner (the method), vllm_bench (`vllm bench serve` cells),
client (our streaming client), metrics (/metrics steady state), results/report (what a run
writes), servers (servers per plan), compare (`inv bench.compare`). docs/bench.md explains it all.
"""
