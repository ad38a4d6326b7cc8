"""Tools around the runtime that no serving node loads: ``keygen`` makes the cluster's TLS credentials
(``ovshard keygen``, ``ovshard up``), ``wanproxy`` emulates a WAN link in front of a TCP server
(``ovshard proxy``, tests, benchmarks)."""
