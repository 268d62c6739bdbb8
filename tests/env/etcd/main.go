// Command etcd is a minimal single-member etcd for tests, built on
// go.etcd.io/etcd/server/v3/embed. It serves plain HTTP on loopback only.
package main

import (
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

func mustURL(s string) url.URL {
	u, err := url.Parse(s)
	if err != nil {
		log.Fatalf("bad url %q: %v", s, err)
	}
	return *u
}

func main() {
	dataDir := flag.String("data-dir", "default.etcd", "data directory")
	clientURL := flag.String("listen-client-url", "http://127.0.0.1:23790", "client URL (listen and advertise)")
	peerURL := flag.String("listen-peer-url", "http://127.0.0.1:23800", "peer URL (listen and advertise)")
	name := flag.String("name", "kubecast-test", "member name")
	noFsync := flag.Bool("unsafe-no-fsync", true, "skip fsync (faster; data may be lost on a crash)")
	logLevel := flag.String("log-level", "warn", "debug, info, warn, error")
	quota := flag.Int64("quota-backend-bytes", 2<<30, "backend size quota")
	flag.Parse()

	cfg := embed.NewConfig()
	cfg.Name = *name
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{mustURL(*clientURL)}
	cfg.AdvertiseClientUrls = cfg.ListenClientUrls
	cfg.ListenPeerUrls = []url.URL{mustURL(*peerURL)}
	cfg.AdvertisePeerUrls = cfg.ListenPeerUrls
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.UnsafeNoFsync = *noFsync
	cfg.QuotaBackendBytes = *quota
	cfg.Logger = "zap"
	cfg.LogLevel = *logLevel
	cfg.LogOutputs = []string{"stderr"}

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("start etcd: %v", err)
	}
	select {
	case <-e.Server.ReadyNotify():
		log.Printf("etcd ready, serving clients on %s", *clientURL)
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		log.Fatal("etcd did not become ready within 60s")
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case s := <-sig:
		log.Printf("received %v, shutting down", s)
		e.Close()
	case err := <-e.Err():
		log.Fatalf("etcd error: %v", err)
	}
}
