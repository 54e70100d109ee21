"""The lab's client: streams requests to an OpenAI-compatible server and replays workloads.

``stream`` sends one turn and records it, ``replay`` drives a workload, ``history`` builds each
turn's messages, ``slo`` searches the largest load under a TTFT SLO, ``summary`` and
``live_ideal`` summarise records, ``server_metrics`` diffs the server's Prometheus metrics.
"""
