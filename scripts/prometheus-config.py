#!/usr/bin/env python3
"""The chart's PodMonitor, ServiceMonitor and PrometheusRule as a plain Prometheus configuration,
for a Prometheus that runs without prometheus-operator (and for the tests, which run Debian's
`prometheus` against the test cluster).

Reads rendered manifests (`helm template ...` or `helm get manifest RELEASE`) on stdin or from a
file and writes prometheus.yml: one scrape job per monitor endpoint, with the
`kubernetes_sd_configs` and relabelling that prometheus-operator generates for it (job
`<kind>/<namespace>/<name>/<i>`; labels namespace, pod, container, endpoint, service, and `job`
as the operator sets it: `<namespace>/<name>` for a PodMonitor, the Service's name for a
ServiceMonitor), and the rules of every PrometheusRule in a rules file beside it.

A field of a monitor this script does not translate is an error, not a silent difference.

usage: prometheus-config.py [MANIFESTS] --out DIR [--api-server URL --ca-file F --token-file F]
                            [--token-file-in-pod PATH=FILE] [--scrape-interval 15s]
                            [--rule-for-max 30s]"""
import argparse
import os
import re
import sys

import yaml

SELECTOR_KEYS = {"matchLabels", "matchExpressions"}
POD_ENDPOINT_KEYS = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "scheme"}
SERVICE_ENDPOINT_KEYS = POD_ENDPOINT_KEYS | {"bearerTokenFile"}
MONITOR_SPEC_KEYS = {"selector", "namespaceSelector", "podMetricsEndpoints", "endpoints",
                     "jobLabel"}


class Unsupported(ValueError):
    pass


class Dumper(yaml.SafeDumper):
    """Every job spelled out (no YAML anchors for the discovery settings they share)."""

    def ignore_aliases(self, data):
        return True


def sanitize(name):
    """A Kubernetes label name as service discovery's meta label suffix."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def only(obj, allowed, what):
    extra = sorted(set(obj) - allowed)
    if extra:
        raise Unsupported(f"{what}: {', '.join(extra)} not translated")


def selector_relabels(selector, role, what):
    """keep/drop rules for a label selector on pod or service labels."""
    only(selector, SELECTOR_KEYS, f"{what}.selector")
    meta = f"__meta_kubernetes_{role}_label_"
    present = f"__meta_kubernetes_{role}_labelpresent_"
    rules = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        rules.append({"action": "keep", "source_labels": [meta + sanitize(key),
                                                           present + sanitize(key)],
                      "regex": f"({value});true"})
    for e in selector.get("matchExpressions") or []:
        only(e, {"key", "operator", "values"}, f"{what}.selector.matchExpressions")
        key, op = sanitize(e["key"]), e["operator"]
        if op in ("In", "NotIn"):
            rules.append({"action": "keep" if op == "In" else "drop",
                          "source_labels": [meta + key, present + key],
                          "regex": f"({'|'.join(e.get('values') or [])});true"})
        elif op in ("Exists", "DoesNotExist"):
            rules.append({"action": "keep" if op == "Exists" else "drop",
                          "source_labels": [present + key], "regex": "true"})
        else:
            raise Unsupported(f"{what}.selector: operator {op}")
    return rules


def namespaces(monitor):
    ns_sel = monitor["spec"].get("namespaceSelector") or {}
    only(ns_sel, {"any", "matchNames"}, "namespaceSelector")
    if ns_sel.get("any"):
        return None
    return ns_sel.get("matchNames") or [monitor["metadata"].get("namespace", "default")]


def scrape_job(monitor, index, endpoint, sd, token_files, default_interval):
    kind, meta = monitor["kind"], monitor["metadata"]
    ns, name = meta.get("namespace", "default"), meta["name"]
    pod_monitor = kind == "PodMonitor"
    what = f"{kind} {ns}/{name}"
    only(endpoint, POD_ENDPOINT_KEYS if pod_monitor else SERVICE_ENDPOINT_KEYS,
         f"{what} endpoint {index}")
    if "port" not in endpoint:
        raise Unsupported(f"{what} endpoint {index}: only named ports are translated")
    sd_config = dict(sd, role="pod" if pod_monitor else "endpoints")
    names = namespaces(monitor)
    if names is not None:
        sd_config["namespaces"] = {"names": names}
    job = {"job_name": f"{'podMonitor' if pod_monitor else 'serviceMonitor'}/{ns}/{name}/{index}",
           "honor_labels": bool(endpoint.get("honorLabels", False)),
           "kubernetes_sd_configs": [sd_config],
           "scrape_interval": endpoint.get("interval", default_interval),
           "metrics_path": endpoint.get("path", "/metrics"),
           "scheme": endpoint.get("scheme", "http")}
    if "scrapeTimeout" in endpoint:
        job["scrape_timeout"] = endpoint["scrapeTimeout"]
    if "bearerTokenFile" in endpoint:
        path = endpoint["bearerTokenFile"]
        job["authorization"] = {"credentials_file": token_files.get(path, path)}
    port = endpoint["port"]
    role = "pod" if pod_monitor else "service"
    relabel = [{"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)"}]
    relabel += selector_relabels(monitor["spec"].get("selector") or {}, role, what)
    port_meta = ("__meta_kubernetes_pod_container_port_name" if pod_monitor
                 else "__meta_kubernetes_endpoint_port_name")
    relabel.append({"action": "keep", "source_labels": [port_meta], "regex": port})
    if not pod_monitor:
        for target_kind, label in (("Node", "node"), ("Pod", "pod")):
            relabel.append({"source_labels": ["__meta_kubernetes_endpoint_address_target_kind",
                                              "__meta_kubernetes_endpoint_address_target_name"],
                            "separator": ";", "regex": f"{target_kind};(.*)",
                            "replacement": "${1}", "target_label": label})
    relabel += [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"}]
    if not pod_monitor:
        relabel.append({"source_labels": ["__meta_kubernetes_service_name"],
                        "target_label": "service"})
    relabel += [{"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"],
                 "target_label": "container"}]
    job_label = monitor["spec"].get("jobLabel")
    if job_label:
        relabel.append({"source_labels": [f"__meta_kubernetes_{role}_label_{sanitize(job_label)}"],
                        "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
    elif pod_monitor:
        relabel.append({"target_label": "job", "replacement": f"{ns}/{name}"})
    else:
        relabel.append({"source_labels": ["__meta_kubernetes_service_name"],
                        "target_label": "job", "replacement": "${1}"})
    relabel.append({"target_label": "endpoint", "replacement": port})
    job["relabel_configs"] = relabel
    return job


def duration_seconds(text):
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text))


def translate(docs, sd, token_files, scrape_interval, rule_for_max=None):
    """(prometheus config without rule_files, rule groups) from rendered manifests."""
    jobs, groups = [], []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("apiVersion") != "monitoring.coreos.com/v1":
            continue
        kind = doc.get("kind")
        if kind in ("PodMonitor", "ServiceMonitor"):
            only(doc["spec"], MONITOR_SPEC_KEYS, f"{kind} {doc['metadata']['name']}")
            key = "podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"
            for i, ep in enumerate(doc["spec"].get(key) or []):
                jobs.append(scrape_job(doc, i, ep, sd, token_files, scrape_interval))
        elif kind == "PrometheusRule":
            for g in doc["spec"].get("groups") or []:
                for rule in g.get("rules", []):
                    if rule_for_max and "for" in rule and \
                            duration_seconds(rule["for"]) > duration_seconds(rule_for_max):
                        rule["for"] = rule_for_max
                groups.append(g)
        else:
            raise Unsupported(f"{kind}: not translated")
    return {"global": {"scrape_interval": scrape_interval}, "scrape_configs": jobs}, groups


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("manifests", nargs="?", help="rendered manifests (default: stdin)")
    ap.add_argument("--out", required=True, help="directory for prometheus.yml and rules.yml")
    ap.add_argument("--api-server", help="the apiserver to discover from (default: in-cluster)")
    ap.add_argument("--ca-file", help="its CA (with --api-server)")
    ap.add_argument("--token-file", help="a token to discover with (with --api-server)")
    ap.add_argument("--token-file-in-pod", action="append", default=[], metavar="PATH=FILE",
                    help="read a monitor's bearerTokenFile PATH from FILE instead")
    ap.add_argument("--scrape-interval", default="15s")
    ap.add_argument("--evaluation-interval", default="15s")
    ap.add_argument("--rule-for-max", help="shorten every rule's `for` to at most this (tests)")
    a = ap.parse_args()
    text = open(a.manifests).read() if a.manifests else sys.stdin.read()
    sd = {}
    if a.api_server:
        sd["api_server"] = a.api_server
        if a.ca_file:
            sd["tls_config"] = {"ca_file": os.path.abspath(a.ca_file)}
        if a.token_file:
            sd["authorization"] = {"credentials_file": os.path.abspath(a.token_file)}
    token_files = dict(kv.split("=", 1) for kv in a.token_file_in_pod)
    token_files = {k: os.path.abspath(v) for k, v in token_files.items()}
    try:
        config, groups = translate(list(yaml.safe_load_all(text)), sd, token_files,
                                   a.scrape_interval, a.rule_for_max)
    except (Unsupported, KeyError, TypeError, yaml.YAMLError) as e:
        sys.exit(f"prometheus-config: {e}")
    os.makedirs(a.out, exist_ok=True)
    config["global"]["evaluation_interval"] = a.evaluation_interval
    if groups:
        rules = os.path.join(os.path.abspath(a.out), "rules.yml")
        with open(rules, "w") as f:
            yaml.dump({"groups": groups}, f, Dumper=Dumper, sort_keys=False)
        config["rule_files"] = [rules]
    with open(os.path.join(a.out, "prometheus.yml"), "w") as f:
        yaml.dump(config, f, Dumper=Dumper, sort_keys=False)
    print(f"{len(config['scrape_configs'])} scrape jobs, "
          f"{sum(len(g.get('rules', [])) for g in groups)} rules in {a.out}")


if __name__ == "__main__":
    main()
