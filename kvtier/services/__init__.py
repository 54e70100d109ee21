"""Local services on 127.0.0.1 started and stopped by kvtier itself (the cluster demo) and by the tests:
Valkey, JuiceFS, HAProxy. Nothing here listens beyond the loopback interface."""
