// producer: a herald producer for the node tests, run as a Pod from an image built on the
// test machine. It publishes events to herald's ingest API with the ServiceAccount token
// that kubelet projects into the Pod (audience "herald"), re-reading the file before every
// request as a producer must (kubelet rotates it), and retries an event with the same id
// until herald acknowledges it (2xx). It prints one line per outcome:
//
//	ack <id> <ms>        herald acknowledged the event (it is stored: it must arrive)
//	retry <id> <why>     not acknowledged yet (herald restarting, connection refused, ...)
//	gaveup <id>          not acknowledged within RETRY_SECONDS
//	control <error>      CONTROL_URL did not answer (each new error once)
//	done published=<n> acked=<n> gaveup=<n>
//
// Environment: INGEST_URL (http://host:port), NAMESPACE, TOKEN_FILE, EVENT_TYPE, PREFIX (ids
// are PREFIX-1, PREFIX-2, ...), RATE (events per second), MAX (events at most), CONTROL_URL
// (optional: polled about once a second; the body "stop" ends publishing), RETRY_SECONDS,
// TIMEOUT_SECONDS (3: a publish without an answer by then is sent again).
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func number(name string, fallback float64) float64 {
	v, err := strconv.ParseFloat(env(name, ""), 64)
	if err != nil {
		return fallback
	}
	return v
}

func main() {
	ingest := strings.TrimRight(env("INGEST_URL", ""), "/")
	namespace := env("NAMESPACE", "")
	tokenFile := env("TOKEN_FILE", "/var/run/secrets/herald/token")
	eventType := env("EVENT_TYPE", "order.created")
	prefix := env("PREFIX", "evt")
	control := env("CONTROL_URL", "")
	rate := number("RATE", 10)
	max := int(number("MAX", 100))
	retryFor := time.Duration(number("RETRY_SECONDS", 120) * float64(time.Second))
	if ingest == "" || namespace == "" {
		fmt.Fprintln(os.Stderr, "INGEST_URL and NAMESPACE are required")
		os.Exit(2)
	}
	url := fmt.Sprintf("%s/v1/namespaces/%s/events", ingest, namespace)
	// herald answers a publish in milliseconds; a request that has no answer within this
	// went to a Pod that is gone (while a rollout moves the Service's endpoints a connection
	// attempt can be sent to a Pod whose network was just removed), and is sent again.
	client := &http.Client{Timeout: time.Duration(number("TIMEOUT_SECONDS", 3) * float64(time.Second))}
	interval := time.Duration(float64(time.Second) / rate)
	published, acked, gaveUp := 0, 0, 0
	lastControl := time.Time{}
	next := time.Now()

	// The control endpoint has a client of its own with a short timeout: a slow answer
	// there must not slow publishing. Its errors are printed (each new one once).
	controlClient := &http.Client{Timeout: 2 * time.Second}
	lastControlError := ""
	stopped := func() bool {
		if control == "" || time.Since(lastControl) < time.Second {
			return false
		}
		lastControl = time.Now()
		resp, err := controlClient.Get(control)
		if err != nil {
			if err.Error() != lastControlError {
				lastControlError = err.Error()
				fmt.Printf("control %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
			}
			return false
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return strings.TrimSpace(string(body)) == "stop"
	}

	for i := 1; i <= max && !stopped(); i++ {
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		} else if d < -time.Second {
			next = time.Now() // after a long retry: no burst to catch up
		}
		next = next.Add(interval)
		id := fmt.Sprintf("%s-%d", prefix, i)
		body, _ := json.Marshal(map[string]any{"id": id, "type": eventType, "data": map[string]any{"seq": i}})
		published++
		deadline := time.Now().Add(retryFor)
		for {
			start := time.Now()
			why := ""
			token, err := os.ReadFile(tokenFile)
			if err != nil {
				why = "token: " + err.Error()
			} else {
				req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
				resp, err := client.Do(req)
				if err != nil {
					why = err.Error()
				} else {
					answer, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
					resp.Body.Close()
					if resp.StatusCode/100 == 2 {
						acked++
						fmt.Printf("ack %s %d\n", id, time.Since(start).Milliseconds())
						break
					}
					why = fmt.Sprintf("%d %s", resp.StatusCode, strings.TrimSpace(string(answer)))
				}
			}
			if time.Now().After(deadline) {
				gaveUp++
				fmt.Printf("gaveup %s %s\n", id, why)
				break
			}
			fmt.Printf("retry %s %s\n", id, strings.ReplaceAll(why, "\n", " "))
			time.Sleep(200 * time.Millisecond)
		}
	}
	fmt.Printf("done published=%d acked=%d gaveup=%d\n", published, acked, gaveUp)
}
