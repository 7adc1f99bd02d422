"""apply.py's patch arithmetic: what a reconcile sends, and when it sends nothing."""

from __future__ import annotations

from kvfleet_operator.apply import forget, is_applied, removals


def test_removals_null_only_what_the_last_apply_set():
    last = {"spec": {"nodeSelector": {"gpu": "h100", "pool": "a"}, "initContainers": [{"n": 1}],
                     "replicas": 2}}
    desired = {"spec": {"nodeSelector": {"pool": "a"}, "replicas": 3}}
    assert removals(last, desired) == {"spec": {"nodeSelector": {"pool": "a", "gpu": None},
                                                "replicas": 3, "initContainers": None}}
    assert removals({}, desired) == desired  # an adopted object: nothing of ours to remove


def test_is_applied_ignores_server_defaults_but_not_stale_or_changed_fields():
    live = {"spec": {"replicas": 3, "dnsPolicy": "ClusterFirst",
                     "containers": [{"name": "c", "image": "i", "imagePullPolicy": "Always"}]}}
    assert is_applied({"spec": {"replicas": 3, "containers": [{"name": "c", "image": "i"}]}}, live)
    assert not is_applied({"spec": {"replicas": 4}}, live)
    assert not is_applied({"spec": {"dnsPolicy": None}}, live)  # a field to remove is still there
    assert is_applied({"spec": {"initContainers": None}}, live)
    assert not is_applied({"spec": {"containers": [{"name": "c"}, {"name": "d"}]}}, live)


def test_a_forgotten_field_is_never_removed():
    last = {"spec": {"replicas": 3, "template": {}}}
    forget(last, ("spec", "replicas"))
    forget(last, ("status", "replicas"))  # absent: nothing to do
    assert removals(last, {"spec": {"template": {}}}) == {"spec": {"template": {}}}
