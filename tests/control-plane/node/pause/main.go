// pause: the sandbox ("pause") image's process for the test node. It holds the pod's
// namespaces open and does nothing else: it sleeps until SIGINT or SIGTERM (then exits 0)
// and reaps any child re-parented to it (it is PID 1 when the pod shares its PID
// namespace). No image is pulled on the test machine, so this is built here and imported
// into containerd by scripts/control-plane.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		os.Stdout.WriteString("pause (herald test node)\n")
		return
	}
	if os.Getpid() != 1 {
		os.Stderr.WriteString("warning: pause should be the first process\n")
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			return
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
