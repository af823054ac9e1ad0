"""The Helm chart (deploy/helm/batchspec), rendered offline by Helm's own engine (the
helm-python-sdk package embeds Helm's Go library) and every object validated, strictly, against
the Kubernetes API schemas of a named version (kubernetes-validate): the default values, TLS
with an API key, and 3 targets with 2 drafts. A missing tool fails; it never skips."""
import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "batchspec"
KUBERNETES_VERSION = "1.33.0"
NAMESPACE = "serving"

VALUE_SETS = {
    "defaults": {},
    "tls": {"tls": {"enabled": True, "secretName": "bs-tls"},
            "apiKey": {"secretName": "bs-api-key"}},
    "3 targets, 2 drafts": {"target": {"replicas": 3, "maxSequences": 48},
                            "draft": {"replicas": 2}, "models": {
                                "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
                            "measured": {"volume": {"hostPath": {"path": "/var/cache/bs"}}}},
}


def helm():
    try:
        import helm_python
    except ImportError:
        pytest.fail("helm-python-sdk (a test dependency) is missing")
    return helm_python


def render(values) -> list[dict]:
    """Every object the chart renders with `values`, as `helm template bs -n serving` would."""
    chart = helm().Chart.load(str(CHART))
    chart.validate_schema(values)
    manifests = chart.render(values, name="bs", namespace=NAMESPACE, is_install=True)
    return [obj for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for obj in yaml.safe_load_all(text) if obj]


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_chart_renders_and_every_object_validates_strictly(name):
    import kubernetes_validate

    objects = render(VALUE_SETS[name])
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "PodDisruptionBudget",
                                             "ServiceAccount", "Role", "RoleBinding"}
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {error.message} at "
                        f"{list(error.path)}")
    report = helm().lint(str(CHART), VALUE_SETS[name], strict=True,
                         kube_version=f"v{KUBERNETES_VERSION}")
    assert not report["errors"] and all(m["severity"] < 2 for m in report["messages"]), report


def test_pools_gpus_probes_draining_and_membership_by_default():
    objects = render({})
    deployments = by_kind(objects, "Deployment")
    # the n-gram draft runs in the coordinator's process: no pool of its own
    assert set(deployments) == {"bs-target", "bs-draft", "bs-coordinator"}
    for pool, port, service in (("bs-target", 50052, "TargetService"),
                                ("bs-draft", 50053, "DraftService")):
        spec = deployments[pool]["spec"]["template"]["spec"]
        main = container(deployments[pool])
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert main["args"][main["args"].index("--device") + 1] == "cuda:0"
        assert main["readinessProbe"]["grpc"] == {"port": port,
                                                  "service": f"batchspec.v1.{service}"}
        assert "tcpSocket" in main["livenessProbe"]  # stays alive while it drains
        grace = int(main["args"][main["args"].index("--grace") + 1])
        assert spec["terminationGracePeriodSeconds"] > grace + main["lifecycle"]["preStop"][
            "sleep"]["seconds"]  # never killed while it still drains
    services = by_kind(objects, "Service")
    for pool in ("bs-target", "bs-draft"):
        assert services[pool]["spec"]["clusterIP"] == "None"  # headless
    assert services["bs-coordinator"]["spec"].get("clusterIP") != "None"
    args = container(deployments["bs-coordinator"])["args"]
    assert args[args.index("--target") + 1] == "k8s:serving/bs-target:50052"
    drafts = [args[i + 1] for i, a in enumerate(args) if a == "--draft"]
    assert drafts == ["k8s:serving/bs-draft:50053", "local:ngram"]
    role = by_kind(objects, "Role")["bs-endpoints-reader"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = by_kind(objects, "RoleBinding")["bs-endpoints-reader"]
    account = deployments["bs-coordinator"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": NAMESPACE}]
    assert set(by_kind(objects, "PodDisruptionBudget")) == set(deployments)
    dockerfile = (ROOT / "Dockerfile").read_text()
    for deployment in deployments.values():  # the images' own non-root user, by number
        context = deployment["spec"]["template"]["spec"]["securityContext"]
        assert context["runAsNonRoot"] and f"--uid {context['runAsUser']} " in dockerfile


def test_tls_mounts_the_secret_and_probes_speak_tls():
    objects = render(VALUE_SETS["tls"])
    for name, deployment in by_kind(objects, "Deployment").items():
        main = container(deployment)
        args = main["args"]
        assert args[args.index("--tls-cert") + 1] == "/tls/tls.crt"
        assert args[args.index("--tls-ca") + 1] == "/tls/ca.pem", name
        probe = main["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["batchspec", "health"] and "--tls-ca" in probe
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "bs-tls"
    args = container(by_kind(objects, "Deployment")["bs-coordinator"])["args"]
    assert args[args.index("--api-key-file") + 1] == "/secrets/api-key"


def test_replicas_per_pool_capacity_and_the_models_volume():
    objects = render(VALUE_SETS["3 targets, 2 drafts"])
    deployments = by_kind(objects, "Deployment")
    assert deployments["bs-target"]["spec"]["replicas"] == 3
    assert deployments["bs-draft"]["spec"]["replicas"] == 2
    args = container(deployments["bs-target"])["args"]
    assert args[args.index("--max-sequences") + 1] == "48"
    volumes = deployments["bs-target"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models"}} in volumes
    # what a service times of its machine: on the volume given (kept across pods on a node),
    # by default an emptyDir (it outlives a restarted container)
    assert {"name": "measured", "hostPath": {"path": "/var/cache/bs"}} in volumes
    default = by_kind(render({}), "Deployment")["bs-draft"]["spec"]["template"]["spec"]
    assert {"name": "measured", "emptyDir": {}} in default["volumes"]
    main = container(deployments["bs-target"])
    measured = next(e["value"] for e in main["env"] if e["name"] == "BATCHSPEC_MEASURED_DIR")
    assert {"name": "measured", "mountPath": measured} in main["volumeMounts"]


def test_cpu_pools_and_the_service_monitor():
    objects = render({"target": {"gpus": 0}, "draft": {"enabled": False},
                      "metrics": {"serviceMonitor": {"enabled": True}}})
    deployments = by_kind(objects, "Deployment")
    assert "bs-draft" not in deployments
    main = container(deployments["bs-target"])
    assert main["args"][main["args"].index("--device") + 1] == "cpu"
    assert "nvidia.com/gpu" not in str(main.get("resources"))
    # the dtypes `batchspec serve` gives: the target --dtype, a draft auto where that is float32
    for values, target, draft in (({}, "float32", "auto"),
                                  ({"dtype": "bfloat16"}, "bfloat16", "bfloat16")):
        pools = by_kind(render({"draft": {"gpus": 0}, "target": {"gpus": 0}, **values}),
                        "Deployment")
        for pool, expected in (("bs-target", target), ("bs-draft", draft)):
            args = container(pools[pool])["args"]
            assert args[args.index("--dtype") + 1] == expected
    args = container(deployments["bs-coordinator"])["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--draft"] == ["local:ngram"]
    without = container(by_kind(render({"ngram": {"enabled": False}}), "Deployment")[
        "bs-coordinator"])["args"]
    assert [without[i + 1] for i, a in enumerate(without) if a == "--draft"] == [
        "k8s:serving/bs-draft:50053"]
    monitor = by_kind(objects, "ServiceMonitor")["bs-metrics"]  # a CRD: checked by hand
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "30s",
                                             "path": "/metrics"}]


@pytest.mark.parametrize("values", [{"target": {"replicas": -1}},
                                    {"target": {"replicas": "three"}},
                                    {"numDraftTokens": 0}, {"draftPolicy": "fast"},
                                    {"tls": {"enabled": True, "secretName": ""}},
                                    {"target": {"gpu": 1}},
                                    {"measured": {"hostPath": {"path": "/x"}}}])
def test_the_values_schema_refuses_bad_values(values):
    chart = helm().Chart.load(str(CHART))
    with pytest.raises(helm().HelmValuesError):
        chart.validate_schema(values)
