"""host/threads.py: the OpenMP environment our CPU actors start with."""

from __future__ import annotations

from skyrl_stepwise.host.threads import cpu_thread_env


def test_cpu_actors_sleep_when_they_wait_unless_the_user_chose_a_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cpu_thread_env(3) == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # e.g. a dedicated many-core engine node
    assert cpu_thread_env(8) == {"OMP_NUM_THREADS": "8", "OMP_WAIT_POLICY": "ACTIVE"}
