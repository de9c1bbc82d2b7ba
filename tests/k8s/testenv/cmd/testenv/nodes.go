// Real nodes (DESIGN.md §7): beside the kwok nodes, N kubelets on this machine, each with its own
// containerd (socket, root and state directories of its own), its own pod subnet on a bridge and
// its own cgroup root, plus one kube-proxy for Services and CoreDNS as the cluster DNS. Every
// address lives on the bridges made here (10.244.0.0/16 for pods and DNS,
// the apiserver's 10.96.0.0/16 for Services); nothing is routed or masqueraded off the machine.
// Only one environment with real nodes runs at a time (a lock), since the bridges and kube-proxy's
// rules belong to the machine; a start first clears what a killed one left behind.
package main

import (
	"bufio"
	"context"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const (
	bridgePrefix = "ssbr"   // ssbr1, ssbr2, ...: node i's bridge, 10.244.i.1/24
	dnsLink      = "ssdns0" // a link of its own (an empty bridge): the DNS and apiserver addresses
	dnsIP        = "10.244.0.10"
	apiIP        = "10.244.0.1" // the apiserver's address when there are real nodes
	cgroupPrefix = "ssnode"     // /sys/fs/cgroup/<controller>/ssnode<i>: node i's cgroup root
	lockPath     = "/run/shardserve-real-nodes.lock"
	leftoverPath = "/run/shardserve-real-nodes.dir" // the directory of the environment holding the lock
	nodeGPUs     = 4
)

func nodeName(i int) string   { return fmt.Sprintf("real-%d", i) }
func nodeIP(i int) string     { return fmt.Sprintf("10.244.%d.1", i) }
func nodeSubnet(i int) string { return fmt.Sprintf("10.244.%d.0/24", i) }

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// realNodes holds the machine-wide lock while the environment runs.
type realNodes struct {
	dir, bin, images string
	n                int
	lock             *os.File
}

// lockMachine takes the real-node lock (failing at once if another environment holds it) and
// clears what an environment that died without stopping left behind.
func lockMachine(dir string) (*os.File, error) {
	f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("another test environment with real nodes is running on this machine (%s is locked)", lockPath)
	}
	if old, err := os.ReadFile(leftoverPath); err == nil && len(old) > 0 {
		cleanMachine(strings.TrimSpace(string(old)))
	} else {
		cleanMachine("")
	}
	if err := os.WriteFile(leftoverPath, []byte(dir+"\n"), 0o600); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// cleanMachine ends every process in the real nodes' cgroups and the shims of their containerds,
// unmounts what their kubelets and containerds mounted under `dir`, deletes the pods' network
// namespaces left behind (removePodNetns), the links made here and kube-proxy's rules. Safe to run
// when nothing is left.
func cleanMachine(dir string) {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/" + cgroupPrefix + "*")
	for _, root := range roots {
		filepath.Walk(root, func(path string, info os.FileInfo, err error) error {
			if err == nil && info.IsDir() {
				if procs, err := os.ReadFile(filepath.Join(path, "cgroup.procs")); err == nil {
					for _, p := range strings.Fields(string(procs)) {
						if pid, err := strconv.Atoi(p); err == nil {
							syscall.Kill(pid, syscall.SIGKILL)
						}
					}
				}
			}
			return nil
		})
	}
	if dir != "" {
		killShims(dir)
		unmountUnder(dir)
	}
	for _, root := range roots {
		removeCgroupTree(root)
	}
	removePodNetns()
	links, _ := filepath.Glob("/sys/class/net/" + bridgePrefix + "*")
	links = append(links, "/sys/class/net/"+dnsLink)
	for _, l := range links {
		if _, err := os.Stat(l); err == nil {
			run("ip", "link", "delete", filepath.Base(l))
		}
	}
	if dir != "" {
		if bin, err := os.ReadFile(filepath.Join(dir, "kube-proxy.bin")); err == nil {
			exec.Command(strings.TrimSpace(string(bin)), "--cleanup").Run()
		}
	}
}

// killShims kills the containerd shims (and so their containers) whose containerd lived in dir.
func killShims(dir string) {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		cmd, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(cmd), "containerd-shim") ||
			!strings.Contains(string(cmd), dir) {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// unmountUnder lazily unmounts every mount point under dir, deepest first.
func unmountUnder(dir string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var points []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) > 4 && (strings.HasPrefix(fields[4], dir+"/") || fields[4] == dir) {
			points = append(points, fields[4])
		}
	}
	f.Close()
	sort.Slice(points, func(a, b int) bool { return len(points[a]) > len(points[b]) })
	for _, p := range points {
		syscall.Unmount(p, syscall.MNT_DETACH)
	}
}

// removePodNetns deletes the network namespaces the nodes' CNI made for pods (/run/netns/cni-*,
// an address on the pod bridges, 10.244.0.0/16) that no process lives in any more. containerd
// removes a pod's namespace when it removes the pod's sandbox, which for a drained pod comes later
// than the environment's end: each end had left its pods' namespaces mounted, and their veth pairs
// on the machine (64 after a few CI runs).
func removePodNetns() {
	names, _ := filepath.Glob("/run/netns/cni-*")
	if len(names) == 0 {
		return
	}
	live := map[uint64]bool{} // the inodes of the network namespaces processes are in
	procs, _ := filepath.Glob("/proc/[0-9]*/ns/net")
	for _, p := range procs {
		var st syscall.Stat_t
		if syscall.Stat(p, &st) == nil {
			live[st.Ino] = true
		}
	}
	for _, path := range names {
		var st syscall.Stat_t
		if syscall.Stat(path, &st) != nil || live[st.Ino] {
			continue
		}
		name := filepath.Base(path)
		out, err := exec.Command("ip", "-n", name, "-4", "-o", "addr", "show").Output()
		if err == nil && strings.Contains(string(out), " 10.244.") {
			run("ip", "netns", "delete", name)
		}
	}
}

func removeCgroupTree(root string) {
	var dirs []string
	filepath.Walk(root, func(path string, info os.FileInfo, err error) error {
		if err == nil && info.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		for try := 0; try < 50; try++ {
			if err := syscall.Rmdir(dirs[i]); err == nil || os.IsNotExist(err) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// prepareNetwork: forwarding on, bridged traffic through iptables (Services between pods of one
// node), the DNS address and one bridge per node.
func prepareNetwork(n int) error {
	for path, value := range map[string]string{
		"/proc/sys/net/ipv4/ip_forward":                "1",
		"/proc/sys/net/bridge/bridge-nf-call-iptables": "1",
	} {
		if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	steps := [][]string{
		{"link", "add", dnsLink, "type", "bridge"},
		{"addr", "add", dnsIP + "/32", "dev", dnsLink},
		{"addr", "add", apiIP + "/32", "dev", dnsLink},
		{"link", "set", dnsLink, "up"},
	}
	for i := 1; i <= n; i++ {
		br := fmt.Sprintf("%s%d", bridgePrefix, i)
		steps = append(steps, []string{"link", "add", br, "type", "bridge"},
			[]string{"addr", "add", nodeIP(i) + "/24", "dev", br},
			[]string{"link", "set", br, "up"})
	}
	for _, s := range steps {
		if err := run("ip", s...); err != nil {
			return err
		}
	}
	return nil
}

// writeNodeCerts: each kubelet's client certificate (system:node:<name>), kube-proxy's and
// CoreDNS's, and the apiserver's client certificate towards the kubelets.
func writeNodeCerts(pki string, ca *keyPair, n int) error {
	subjects := map[string]pkix.Name{
		"kube-proxy": {CommonName: "system:kube-proxy"},
		// CoreDNS reads Services, EndpointSlices and Namespaces; the test control plane's
		// masters group keeps this environment short.
		"coredns": {CommonName: "coredns", Organization: []string{"system:masters"}},
	}
	for i := 1; i <= n; i++ {
		subjects[nodeName(i)] = pkix.Name{CommonName: "system:node:" + nodeName(i),
			Organization: []string{"system:nodes"}}
	}
	for name, subject := range subjects {
		c, err := newCert(&x509.Certificate{Subject: subject,
			KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}, ca)
		if err != nil {
			return err
		}
		if err := c.write(pki, name); err != nil {
			return err
		}
	}
	return nil
}

// start (after prepareNetwork) starts CoreDNS, then per node a containerd (the images imported) and a
// kubelet, then kube-proxy; it returns once every node is Ready and advertises its GPUs.
func (r *realNodes) start(server, pki string, add func(*component)) error {
	for _, user := range []string{"kube-proxy", "coredns"} {
		if err := writeKubeconfig(filepath.Join(r.dir, user+".kubeconfig"), server, pki, user); err != nil {
			return err
		}
	}
	corefile := filepath.Join(r.dir, "Corefile")
	if err := os.WriteFile(corefile, []byte(fmt.Sprintf(`.:53 {
    bind %s
    errors
    kubernetes cluster.local in-addr.arpa {
        kubeconfig %s testenv
        pods insecure
        ttl 5
    }
}
`, dnsIP, filepath.Join(r.dir, "coredns.kubeconfig"))), 0o644); err != nil {
		return err
	}
	dns, err := start(r.dir, r.bin, "coredns", "-conf", corefile)
	if err != nil {
		return err
	}
	add(dns)

	imports, _ := filepath.Glob(filepath.Join(r.images, "*.tar"))
	if len(imports) == 0 {
		return fmt.Errorf("no images in %q (scripts/images/build.sh builds them)", r.images)
	}
	for i := 1; i <= r.n; i++ {
		if err := r.startNode(i, server, pki, imports, add); err != nil {
			return fmt.Errorf("node %s: %w", nodeName(i), err)
		}
	}
	if err := os.WriteFile(filepath.Join(r.dir, "kube-proxy.bin"), []byte(filepath.Join(r.bin, "kube-proxy")), 0o644); err != nil {
		return err
	}
	healthz, err := freePort()
	if err != nil {
		return err
	}
	metrics, err := freePort()
	if err != nil {
		return err
	}
	proxy, err := start(r.dir, r.bin, "kube-proxy",
		"--kubeconfig="+filepath.Join(r.dir, "kube-proxy.kubeconfig"),
		"--hostname-override="+nodeName(1), "--proxy-mode=iptables",
		"--cluster-cidr=10.244.0.0/16", "--conntrack-max-per-core=0",
		"--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
		fmt.Sprintf("--healthz-bind-address=127.0.0.1:%d", healthz),
		fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", metrics), "--v=1")
	if err != nil {
		return err
	}
	add(proxy)
	return r.waitNodes()
}

func (r *realNodes) startNode(i int, server, pki string, imports []string, add func(*component)) error {
	name := nodeName(i)
	d := filepath.Join(r.dir, "nodes", name)
	for _, sub := range []string{"containerd", "cni", "kubelet", "pod-logs", "ipam", "certs.d"} {
		if err := os.MkdirAll(filepath.Join(d, sub), 0o755); err != nil {
			return err
		}
	}
	sock := filepath.Join(d, "containerd.sock")
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/shardserve/pause:dev"
  # The machine's processes lack CAP_SYS_RESOURCE: an oom_score_adj below the parent's fails.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  # Registries by host (<dir>/certs.d/HOST/hosts.toml), read at each pull: a test may add one.
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = %q
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
`, filepath.Join(d, "containerd", "root"), filepath.Join(d, "containerd", "state"), sock,
		filepath.Join(d, "cni"), filepath.Join(d, "certs.d"))
	configPath := filepath.Join(d, "containerd.toml")
	if err := os.WriteFile(configPath, []byte(config), 0o644); err != nil {
		return err
	}
	cni := map[string]any{
		"cniVersion": "1.0.0", "name": "shardserve-" + name,
		"plugins": []any{map[string]any{
			"type": "bridge", "bridge": fmt.Sprintf("%s%d", bridgePrefix, i), "isGateway": true,
			"ipMasq": false, "hairpinMode": true,
			"ipam": map[string]any{"type": "host-local", "dataDir": filepath.Join(d, "ipam"),
				"ranges": [][]map[string]string{{{"subnet": nodeSubnet(i), "gateway": nodeIP(i)}}},
				"routes": []map[string]string{{"dst": "0.0.0.0/0"}}},
		}},
	}
	cniJSON, _ := json.MarshalIndent(cni, "", "  ")
	if err := os.WriteFile(filepath.Join(d, "cni", "10-shardserve.conflist"), cniJSON, 0o644); err != nil {
		return err
	}
	ctrd, err := startAs(r.dir, "containerd-"+name, "containerd", "--config", configPath)
	if err != nil {
		return err
	}
	add(ctrd)
	deadline := time.Now().Add(60 * time.Second)
	for {
		if err := run("ctr", "--address", sock, "version"); err == nil {
			break
		} else if time.Now().After(deadline) {
			return fmt.Errorf("containerd did not start: %w (log %s)", err, filepath.Join(r.dir, "containerd-"+name+".log"))
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, image := range imports {
		if err := run("ctr", "--address", sock, "-n", "k8s.io", "images", "import",
			"--no-unpack", image); err != nil {
			return err
		}
	}

	// Node i's own cgroup root, so that no kubelet takes another's pods for orphans.
	controllers, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, c := range controllers {
		if st, err := os.Stat(c); err == nil && st.IsDir() {
			os.MkdirAll(filepath.Join(c, fmt.Sprintf("%s%d", cgroupPrefix, i)), 0o755)
		}
	}
	resolv := filepath.Join(d, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("# pods resolve through the cluster DNS only\n"), 0o644); err != nil {
		return err
	}
	port, err := freePort()
	if err != nil {
		return err
	}
	healthz, err := freePort()
	if err != nil {
		return err
	}
	kubeletConfig := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %s
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
cgroupRoot: /%s%d
failSwapOn: false
failCgroupV1: false
containerRuntimeEndpoint: unix://%s
clusterDNS: [%s]
clusterDomain: cluster.local
resolvConf: %s
podLogsDir: %s
maxPods: 40
serializeImagePulls: false
syncFrequency: 10s
evictionHard: {memory.available: "100Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
`, nodeIP(i), port, healthz, filepath.Join(pki, "ca.crt"), cgroupPrefix, i, sock, dnsIP, resolv,
		filepath.Join(d, "pod-logs"))
	if err := os.WriteFile(filepath.Join(d, "kubelet.yaml"), []byte(kubeletConfig), 0o644); err != nil {
		return err
	}
	kubeconfig := filepath.Join(d, "kubelet.kubeconfig")
	if err := writeKubeconfig(kubeconfig, server, pki, name); err != nil {
		return err
	}
	kubelet, err := startAs(r.dir, "kubelet-"+name, filepath.Join(r.bin, "kubelet"),
		"--config="+filepath.Join(d, "kubelet.yaml"), "--kubeconfig="+kubeconfig,
		"--hostname-override="+name, "--node-ip="+nodeIP(i),
		"--root-dir="+filepath.Join(d, "kubelet"), "--cert-dir="+filepath.Join(d, "kubelet", "pki"),
		"--node-labels=shardserve.io/node-kind=real,topology.kubernetes.io/zone=zone-a", "--v=1")
	if err != nil {
		return err
	}
	add(kubelet)
	return nil
}

// waitNodes waits until every real node is Ready, then advertises its GPUs (an extended
// resource, as a device plugin would) so that placement sees them as on any GPU node.
func (r *realNodes) waitNodes() error {
	kubeconfig := filepath.Join(r.dir, "kubeconfig")
	ctx, cancel := context.WithTimeout(context.Background(), 180*time.Second)
	defer cancel()
	for i := 1; i <= r.n; i++ {
		for {
			out, _ := exec.CommandContext(ctx, "kubectl", "--kubeconfig", kubeconfig, "get", "node",
				nodeName(i), "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`).Output()
			if strings.TrimSpace(string(out)) == "True" {
				break
			}
			if ctx.Err() != nil {
				return fmt.Errorf("node %s did not become Ready (log %s)", nodeName(i),
					filepath.Join(r.dir, "kubelet-"+nodeName(i)+".log"))
			}
			time.Sleep(300 * time.Millisecond)
		}
		// Allocatable too: the kubelet derives it from capacity only at its next status report.
		patch := fmt.Sprintf(`[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"%d"},`+
			`{"op":"add","path":"/status/allocatable/nvidia.com~1gpu","value":"%d"}]`, nodeGPUs, nodeGPUs)
		out, err := exec.CommandContext(ctx, "kubectl", "--kubeconfig", kubeconfig, "patch", "node",
			nodeName(i), "--subresource=status", "--type=json", "-p", patch).CombinedOutput()
		if err != nil {
			return fmt.Errorf("advertising GPUs on %s: %v: %s", nodeName(i), err, out)
		}
	}
	return nil
}

// drain deletes every pod on the real nodes and waits (bounded) for their kubelets to tear them
// down, so that volumes are unmounted and addresses released before the nodes stop.
func (r *realNodes) drain() {
	kubeconfig := filepath.Join(r.dir, "kubeconfig")
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	for i := 1; i <= r.n; i++ {
		exec.CommandContext(ctx, "kubectl", "--kubeconfig", kubeconfig, "delete", "pods", "-A",
			"--field-selector=spec.nodeName="+nodeName(i), "--wait=false").Run()
	}
	for ctx.Err() == nil {
		out, _ := exec.CommandContext(ctx, "kubectl", "--kubeconfig", kubeconfig, "get", "pods", "-A",
			"-o", "jsonpath={.items[*].spec.nodeName}").Output()
		if !strings.Contains(string(out), "real-") {
			return
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// stop clears the machine (after the components have stopped) and releases the lock.
func (r *realNodes) stop() {
	cleanMachine(r.dir)
	os.Remove(leftoverPath)
	r.lock.Close()
}
