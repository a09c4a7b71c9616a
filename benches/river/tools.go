//go:build tools

// River's CLI (`river bench`), the benchmarks' PostgreSQL reference (scripts/river builds
// it; tests/scale_out.rs runs it). A benchmark tool, never a dependency of herald.
package tools

import _ "github.com/riverqueue/river/cmd/river"
