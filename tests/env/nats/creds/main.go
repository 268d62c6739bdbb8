// Command nats-creds writes what the credentials-file test needs for a nats-server in
// operator (decentralised JWT) mode, into DIR:
//
//	operator.conf   server settings: the operator JWT, a memory resolver preloaded with the
//	                system account and the account KUBECAST (JetStream enabled)
//	user.creds      a user of KUBECAST: its JWT and nkey seed, as `nsc` writes them
//	stranger.creds  a user signed by an account the server does not know (refused)
//
// Usage: nats-creds DIR. Every run makes fresh keys; the files are for tests only.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: nats-creds DIR")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "nats-creds:", err)
		os.Exit(1)
	}
}

func run(dir string) error {
	operator, err := nkeys.CreateOperator()
	if err != nil {
		return err
	}
	operatorPub, _ := operator.PublicKey()
	oc := jwt.NewOperatorClaims(operatorPub)
	oc.Name = "kubecast-test"
	operatorJWT, err := oc.Encode(operator)
	if err != nil {
		return err
	}
	sysPub, sysJWT, _, err := account(operator, "SYS", false)
	if err != nil {
		return err
	}
	accPub, accJWT, acc, err := account(operator, "KUBECAST", true)
	if err != nil {
		return err
	}
	if err := writeCreds(filepath.Join(dir, "user.creds"), acc, "kubecast"); err != nil {
		return err
	}
	// An account the server was never told about: its users are refused.
	stranger, _ := nkeys.CreateAccount()
	if err := writeCreds(filepath.Join(dir, "stranger.creds"), stranger, "stranger"); err != nil {
		return err
	}
	conf := fmt.Sprintf("operator: %q\nsystem_account: %s\nresolver: MEMORY\nresolver_preload: {\n  %s: %q\n  %s: %q\n}\n",
		operatorJWT, sysPub, sysPub, sysJWT, accPub, accJWT)
	return os.WriteFile(filepath.Join(dir, "operator.conf"), []byte(conf), 0o600)
}

// account makes an account signed by the operator, with unlimited JetStream if asked.
func account(operator nkeys.KeyPair, name string, jetstream bool) (string, string, nkeys.KeyPair, error) {
	kp, err := nkeys.CreateAccount()
	if err != nil {
		return "", "", nil, err
	}
	pub, _ := kp.PublicKey()
	ac := jwt.NewAccountClaims(pub)
	ac.Name = name
	if jetstream {
		ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	}
	token, err := ac.Encode(operator)
	return pub, token, kp, err
}

// writeCreds writes a credentials file for a new user signed by account.
func writeCreds(path string, account nkeys.KeyPair, name string) error {
	user, err := nkeys.CreateUser()
	if err != nil {
		return err
	}
	pub, _ := user.PublicKey()
	uc := jwt.NewUserClaims(pub)
	uc.Name = name
	token, err := uc.Encode(account)
	if err != nil {
		return err
	}
	seed, _ := user.Seed()
	creds, err := jwt.FormatUserConfig(token, seed)
	if err != nil {
		return err
	}
	return os.WriteFile(path, creds, 0o600)
}
