// testenv runs a real Kubernetes control plane on loopback for shardserve's tests and for people
// (DESIGN.md §7): embedded etcd, kube-apiserver, kube-controller-manager (garbage collection,
// namespaces, service accounts), kube-scheduler and kwok (fake nodes that heartbeat, bound pods
// that turn Running), all built from the Go module proxy. Certificates are generated per run; TLS
// is always verified.
//
//	testenv up --dir DIR [--bin BINDIR] [--crds DIR]
//	                                      start, write DIR/kubeconfig and DIR/env, run until
//	                                      SIGTERM/SIGINT, then stop everything; SIGUSR1
//	                                      restarts kube-apiserver over a compacted etcd
//
// DIR/ready appears once the apiserver answers /readyz and the default service account exists.
package main

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	nodefast "sigs.k8s.io/kwok/kustomize/stage/node/fast"
	nodelease "sigs.k8s.io/kwok/kustomize/stage/node/heartbeat-with-lease"
	podfast "sigs.k8s.io/kwok/kustomize/stage/pod/fast"
)

func main() {
	if len(os.Args) < 2 || os.Args[1] != "up" {
		fmt.Fprintln(os.Stderr, "usage: testenv up --dir DIR [--bin BINDIR]")
		os.Exit(2)
	}
	fs := flag.NewFlagSet("up", flag.ExitOnError)
	dir := fs.String("dir", "", "state directory (certificates, etcd data, kubeconfig)")
	bin := fs.String("bin", "", "directory of kube-apiserver, kube-controller-manager, kube-scheduler, kwok (default: next to testenv)")
	crds := fs.String("crds", "", "CRDs to install (kubectl apply -f) before the controllers start, so the garbage collector knows them from the outset")
	nodes := fs.Int("real-nodes", 0, "real nodes to start beside the kwok ones (kubelet + containerd each; nodes.go)")
	images := fs.String("images", "", "OCI image archives (*.tar) to import into each real node's containerd")
	fs.Parse(os.Args[2:])
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "testenv: --dir is required")
		os.Exit(2)
	}
	if *bin == "" {
		exe, _ := os.Executable()
		*bin = filepath.Dir(exe)
	}
	if err := up(*dir, *bin, *crds, *nodes, *images); err != nil {
		fmt.Fprintln(os.Stderr, "testenv:", err)
		os.Exit(1)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

type keyPair struct {
	cert *x509.Certificate
	key  *rsa.PrivateKey
}

func newCert(tmpl *x509.Certificate, parent *keyPair) (*keyPair, error) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl.SerialNumber = serial
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	if tmpl.NotAfter.IsZero() {
		tmpl.NotAfter = time.Now().Add(10 * 365 * 24 * time.Hour)
	}
	signer, signerKey := tmpl, key
	if parent != nil {
		signer, signerKey = parent.cert, parent.key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &keyPair{cert, key}, nil
}

func (k *keyPair) write(dir, name string) error {
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: k.cert.Raw})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k.key)})
	if err := os.WriteFile(filepath.Join(dir, name+".crt"), certPEM, 0o600); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, name+".key"), keyPEM, 0o600)
}

// Certificates: a CA, the apiserver's serving certificate (127.0.0.1, localhost, the address
// pods reach it at when there are real nodes, and the kubernetes Service's), client
// certificates for the admin (system:masters), each component and the apiserver towards the
// kubelets, and the service-account key. Returns the CA, which signs the real nodes' too.
func writeCerts(pki string) (*keyPair, error) {
	ca, err := newCert(&x509.Certificate{Subject: pkix.Name{CommonName: "shardserve-testenv-ca"},
		IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}, nil)
	if err != nil {
		return nil, err
	}
	if err := ca.write(pki, "ca"); err != nil {
		return nil, err
	}
	serving, err := newCert(&x509.Certificate{Subject: pkix.Name{CommonName: "kube-apiserver"},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(apiIP), net.ParseIP("10.96.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}, ca)
	if err != nil {
		return nil, err
	}
	if err := serving.write(pki, "apiserver"); err != nil {
		return nil, err
	}
	clients := map[string]pkix.Name{
		"admin":              {CommonName: "admin", Organization: []string{"system:masters"}},
		"controller-manager": {CommonName: "system:kube-controller-manager"},
		"scheduler":          {CommonName: "system:kube-scheduler"},
		"kwok":               {CommonName: "kwok", Organization: []string{"system:masters"}},
		"kubelet-client":     {CommonName: "kube-apiserver-kubelet-client", Organization: []string{"system:masters"}},
		// The aggregation layer's identity towards extension apiservers (KEDA's metrics adapter).
		"front-proxy-client": {CommonName: "front-proxy-client"},
	}
	for name, subject := range clients {
		c, err := newCert(&x509.Certificate{Subject: subject,
			KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}, ca)
		if err != nil {
			return nil, err
		}
		if err := c.write(pki, name); err != nil {
			return nil, err
		}
	}
	sa, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(sa)})
	return ca, os.WriteFile(filepath.Join(pki, "sa.key"), keyPEM, 0o600)
}

func writeKubeconfig(path, server, pki, user string) error {
	text := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: testenv
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: %s
  user:
    client-certificate: %s
    client-key: %s
contexts:
- name: testenv
  context: {cluster: testenv, user: %s, namespace: default}
current-context: testenv
`, server, filepath.Join(pki, "ca.crt"), user, filepath.Join(pki, user+".crt"),
		filepath.Join(pki, user+".key"), user)
	return os.WriteFile(path, []byte(text), 0o600)
}

type component struct {
	name, dir, exe string
	args           []string
	cmd            *exec.Cmd
	done           chan struct{} // closed when the process has exited; err is then set
	err            error
}

func start(dir, bin, name string, args ...string) (*component, error) {
	return startAs(dir, name, filepath.Join(bin, name), args...)
}

// startAs starts exe (a path, or a name looked up in PATH), logging to dir/name.log.
func startAs(dir, name, exe string, args ...string) (*component, error) {
	return launch(dir, exe, name, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, args)
}

// again starts the component anew, appending to its log (which keeps why it exited).
func (c *component) again() (*component, error) {
	return launch(c.dir, c.exe, c.name, os.O_CREATE|os.O_APPEND|os.O_WRONLY, c.args)
}

func launch(dir, exe, name string, logFlags int, args []string) (*component, error) {
	logf, err := os.OpenFile(filepath.Join(dir, name+".log"), logFlags, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	c := &component{name: name, dir: dir, exe: exe, args: args, cmd: cmd, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		logf.Close()
		close(c.done)
	}()
	return c, nil
}

func (c *component) stop() {
	select {
	case <-c.done:
		return
	default:
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		c.cmd.Process.Kill()
		<-c.done
	}
}

// waitReady polls until every path answers 200 (with the admin certificate).
func waitReady(server, pki string, deadline time.Time, apiserver *component, paths ...string) error {
	ca, err := os.ReadFile(filepath.Join(pki, "ca.crt"))
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	cert, err := tls.LoadX509KeyPair(filepath.Join(pki, "admin.crt"), filepath.Join(pki, "admin.key"))
	if err != nil {
		return err
	}
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}}}}
	for time.Now().Before(deadline) {
		select {
		case <-apiserver.done:
			return fmt.Errorf("kube-apiserver exited: %v", apiserver.err)
		default:
		}
		ok := true
		for _, path := range paths {
			resp, err := client.Get(server + path)
			if err != nil {
				ok = false
				break
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				ok = false
				break
			}
		}
		if ok {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("the control plane was not ready in time")
}

func up(dir, bin, crds string, realNodeCount int, images string) error {
	pki := filepath.Join(dir, "pki")
	if err := os.MkdirAll(pki, 0o700); err != nil {
		return err
	}
	os.Remove(filepath.Join(dir, "ready"))
	ca, err := writeCerts(pki)
	if err != nil {
		return fmt.Errorf("certificates: %w", err)
	}
	var real *realNodes
	if realNodeCount > 0 {
		if dir, err = filepath.Abs(dir); err != nil {
			return err
		}
		lock, err := lockMachine(dir)
		if err != nil {
			return err
		}
		real = &realNodes{dir: dir, bin: bin, images: images, n: realNodeCount, lock: lock}
		defer real.stop() // after every component has stopped
		if err := writeNodeCerts(pki, ca, realNodeCount); err != nil {
			return fmt.Errorf("certificates: %w", err)
		}
	}

	// etcd, embedded, on loopback.
	clientPort, err := freePort()
	if err != nil {
		return err
	}
	peerPort, err := freePort()
	if err != nil {
		return err
	}
	cfg := embed.NewConfig()
	cfg.Dir = filepath.Join(dir, "etcd")
	cfg.LogLevel = "error"
	cu, _ := url.Parse("http://127.0.0.1:" + strconv.Itoa(clientPort))
	pu, _ := url.Parse("http://127.0.0.1:" + strconv.Itoa(peerPort))
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster = cfg.Name + "=" + pu.String()
	etcd, err := embed.StartEtcd(cfg)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer etcd.Close()
	select {
	case <-etcd.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		return fmt.Errorf("etcd did not start")
	}

	apiPort, err := freePort()
	if err != nil {
		return err
	}
	// With real nodes, pods reach the apiserver (through the kubernetes Service): it listens on a
	// bridge address of this machine's own instead of loopback.
	apiHost := "127.0.0.1"
	if real != nil {
		apiHost = apiIP
		if err := prepareNetwork(realNodeCount); err != nil {
			return fmt.Errorf("real nodes: %w", err)
		}
	}
	server := "https://" + apiHost + ":" + strconv.Itoa(apiPort)
	kubeconfig := filepath.Join(dir, "kubeconfig")
	for _, user := range []string{"admin", "controller-manager", "scheduler", "kwok"} {
		path := filepath.Join(dir, user+".kubeconfig")
		if user == "admin" {
			path = kubeconfig
		}
		if err := writeKubeconfig(path, server, pki, user); err != nil {
			return err
		}
	}
	p := func(name string) string { return filepath.Join(pki, name) }
	apiserverArgs := []string{"--etcd-servers=" + cu.String(),
		"--bind-address=" + apiHost, "--secure-port=" + strconv.Itoa(apiPort),
		"--advertise-address=" + apiHost,
		"--tls-cert-file=" + p("apiserver.crt"), "--tls-private-key-file=" + p("apiserver.key"),
		"--client-ca-file=" + p("ca.crt"),
		"--service-account-key-file=" + p("sa.key"),
		"--service-account-signing-key-file=" + p("sa.key"),
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-cluster-ip-range=10.96.0.0/16",
		"--kubelet-client-certificate=" + p("kubelet-client.crt"),
		"--kubelet-client-key=" + p("kubelet-client.key"),
		"--kubelet-preferred-address-types=InternalIP",
		"--authorization-mode=Node,RBAC",
		// The aggregation layer (APIService): who it says it proxies for, and as whom; it
		// dials an extension apiserver's endpoints, not its ClusterIP (kwok-only clusters have
		// no kube-proxy).
		"--requestheader-client-ca-file=" + p("ca.crt"),
		"--requestheader-allowed-names=front-proxy-client",
		"--requestheader-username-headers=X-Remote-User",
		"--requestheader-group-headers=X-Remote-Group",
		"--requestheader-extra-headers-prefix=X-Remote-Extra-",
		"--proxy-client-cert-file=" + p("front-proxy-client.crt"),
		"--proxy-client-key-file=" + p("front-proxy-client.key"),
		"--enable-aggregator-routing=true",
		"--storage-media-type=application/json",
		"--v=1"}
	apiserver, err := start(dir, bin, "kube-apiserver", apiserverArgs...)
	if err != nil {
		return err
	}
	components := []*component{apiserver}
	var componentsMu sync.Mutex
	defer func() {
		componentsMu.Lock()
		defer componentsMu.Unlock()
		for i := len(components) - 1; i >= 0; i-- {
			components[i].stop()
		}
	}()
	if err := waitReady(server, pki, time.Now().Add(120*time.Second), apiserver, "/readyz"); err != nil {
		return fmt.Errorf("%w (logs in %s)", err, dir)
	}
	if crds != "" {
		out, err := exec.Command("kubectl", "--kubeconfig", kubeconfig, "apply", "-f", crds).CombinedOutput()
		if err != nil {
			return fmt.Errorf("installing %s: %v: %s", crds, err, out)
		}
		out, err = exec.Command("kubectl", "--kubeconfig", kubeconfig, "wait", "--for",
			"condition=established", "--timeout=60s", "crd", "--all").CombinedOutput()
		if err != nil {
			return fmt.Errorf("waiting for %s: %v: %s", crds, err, out)
		}
	}
	controllers := "garbage-collector-controller,namespace-controller,serviceaccount-controller," +
		"serviceaccount-token-controller,node-lifecycle-controller,pod-garbage-collector-controller," +
		"root-ca-certificate-publisher-controller,taint-eviction-controller," +
		"horizontal-pod-autoscaler-controller"
	if real != nil { // Services on real nodes need their endpoints; Deployments their pods
		controllers += ",endpointslice-controller,endpoints-controller,deployment-controller," +
			"replicaset-controller"
	}
	kcm, err := start(dir, bin, "kube-controller-manager",
		"--kubeconfig="+filepath.Join(dir, "controller-manager.kubeconfig"),
		"--authentication-kubeconfig="+filepath.Join(dir, "controller-manager.kubeconfig"),
		"--authorization-kubeconfig="+filepath.Join(dir, "controller-manager.kubeconfig"),
		"--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
		"--use-service-account-credentials=true",
		"--service-account-private-key-file="+p("sa.key"), "--root-ca-file="+p("ca.crt"),
		"--controllers="+controllers,
		"--horizontal-pod-autoscaler-sync-period=1s",
		"--v=1")
	if err != nil {
		return err
	}
	components = append(components, kcm)
	sched, err := start(dir, bin, "kube-scheduler",
		"--kubeconfig="+filepath.Join(dir, "scheduler.kubeconfig"),
		"--authentication-kubeconfig="+filepath.Join(dir, "scheduler.kubeconfig"),
		"--authorization-kubeconfig="+filepath.Join(dir, "scheduler.kubeconfig"),
		"--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false", "--v=1")
	if err != nil {
		return err
	}
	components = append(components, sched)
	// kwok's own stage definitions: nodes initialize and heartbeat with a lease; bound pods turn
	// Running and Ready, and are removed once deleted.
	stages := strings.Join([]string{nodefast.DefaultNodeInit,
		nodelease.DefaultNodeHeartbeatWithLease, podfast.DefaultPodReady,
		podfast.DefaultPodComplete, podfast.DefaultPodDelete}, "\n---\n")
	kwokConfig := filepath.Join(dir, "kwok.yaml")
	if err := os.WriteFile(kwokConfig, []byte(stages), 0o644); err != nil {
		return err
	}
	kwok, err := start(dir, bin, "kwok",
		"--config="+kwokConfig,
		"--kubeconfig="+filepath.Join(dir, "kwok.kubeconfig"),
		"--manage-all-nodes=false",
		"--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
		"--manage-nodes-with-label-selector=",
		"--node-ip=10.0.0.1", "--node-lease-duration-seconds=40",
		"--server-address=127.0.0.1:0")
	if err != nil {
		return err
	}
	components = append(components, kwok)
	if real != nil {
		err := real.start(server, pki, func(c *component) {
			componentsMu.Lock()
			components = append(components, c)
			componentsMu.Unlock()
		})
		if err != nil {
			return fmt.Errorf("real nodes: %w (logs in %s)", err, dir)
		}
	}

	// The default service account appears once the controller manager runs.
	if err := waitReady(server, pki, time.Now().Add(180*time.Second), apiserver, "/readyz",
		"/api/v1/namespaces/default/serviceaccounts/default"); err != nil {
		return fmt.Errorf("%w (logs in %s)", err, dir)
	}
	env := fmt.Sprintf("export KUBECONFIG=%s\nexport SHARDSERVE_TESTENV_SERVER=%s\n", kubeconfig, server)
	if err := os.WriteFile(filepath.Join(dir, "env"), []byte(env), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "ready"), []byte(server+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Printf("testenv: kube-apiserver at %s; kubeconfig %s\n", server, kubeconfig)

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	// kube-apiserver exiting on its own ends the environment (SIGUSR1 restarts excepted). The
	// other components are restarted, as a kubelet restarts a control plane's static pods
	// (kube-scheduler, for one, exits on purpose when it finds its cache inconsistent), up to
	// ten times each.
	var restarting atomic.Bool
	var watch func(i int, c *component, restarts int)
	watch = func(i int, c *component, restarts int) {
		select {
		case <-c.done:
			if c.name == "kube-apiserver" && restarting.Load() {
				return
			}
			fmt.Fprintf(os.Stderr, "testenv: %s exited: %v (log %s)\n", c.name, c.err,
				filepath.Join(dir, c.name+".log"))
			if c.name == "kube-apiserver" || restarts >= 10 || ctx.Err() != nil {
				cancel()
				return
			}
			componentsMu.Lock()
			next, err := c.again()
			if err == nil {
				components[i] = next
			}
			componentsMu.Unlock()
			if err != nil {
				fmt.Fprintf(os.Stderr, "testenv: restarting %s: %v\n", c.name, err)
				cancel()
				return
			}
			fmt.Fprintf(os.Stderr, "testenv: %s restarted\n", c.name)
			watch(i, next, restarts+1)
		case <-ctx.Done():
		}
	}
	for i, c := range components {
		go watch(i, c, 0)
	}
	// SIGUSR1: restart kube-apiserver with etcd compacted past every resourceVersion it handed
	// out, so that watches resuming from an old version get 410 Gone (for informer tests).
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	for {
		select {
		case <-ctx.Done():
			os.Remove(filepath.Join(dir, "ready"))
			if real != nil {
				real.drain()
			}
			return nil
		case <-usr1:
			os.Remove(filepath.Join(dir, "ready"))
			restarting.Store(true)
			componentsMu.Lock()
			components[0].stop()
			componentsMu.Unlock()
			if err := compact(cu.String()); err != nil {
				return fmt.Errorf("compacting etcd: %w", err)
			}
			apiserver, err := start(dir, bin, "kube-apiserver", apiserverArgs...)
			if err != nil {
				return err
			}
			componentsMu.Lock()
			components[0] = apiserver
			componentsMu.Unlock()
			restarting.Store(false)
			go watch(0, apiserver, 0)
			if err := waitReady(server, pki, time.Now().Add(120*time.Second), apiserver, "/readyz"); err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, "ready"), []byte(server+"\n"), 0o644); err != nil {
				return err
			}
		}
	}
}

// compact writes one key (so the revision moves past every version handed out) and compacts
// etcd at the new revision.
func compact(endpoint string) error {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 10 * time.Second})
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	put, err := cli.Put(ctx, "/shardserve-testenv/compaction", time.Now().String())
	if err != nil {
		return err
	}
	_, err = cli.Compact(ctx, put.Header.Revision, clientv3.WithCompactPhysical())
	return err
}
