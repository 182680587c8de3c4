package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// pythonEnv is the interpreter that runs the engines (and the bench driver)
// and the environment they start from.
type pythonEnv struct {
	Python string
	Source string // where Python came from, for messages
	Env    []string
}

// findPython picks the engines' interpreter: explicit (--python or the
// config file), else $FRMPS_PYTHON, else the virtualenv of the source
// checkout this binary lives in (<checkout>/bin/frmps →
// <checkout>/.venv/bin/python, what `make venv` creates), else python3 from
// PATH. A binary inside a checkout also puts the checkout's vllmpatch/src
// first on PYTHONPATH, so the engine package is the one built with it.
// exe is this binary's path with symlinks resolved; environ the process's
// environment.
func findPython(explicit, exe string, environ []string) pythonEnv {
	env := slices.Clone(environ)
	root := filepath.Dir(filepath.Dir(exe))
	src := filepath.Join(root, "vllmpatch", "src")
	inCheckout := exe != "" && isFile(filepath.Join(src, "frmps_engine", "__init__.py"))
	if inCheckout {
		env = prependPath(env, "PYTHONPATH", src)
	}
	switch venv := filepath.Join(root, ".venv", "bin", "python"); {
	case explicit != "":
		return pythonEnv{Python: explicit, Source: "--python", Env: env}
	case lookupEnv(environ, "FRMPS_PYTHON") != "":
		return pythonEnv{Python: lookupEnv(environ, "FRMPS_PYTHON"), Source: "$FRMPS_PYTHON", Env: env}
	case inCheckout && isFile(venv):
		return pythonEnv{Python: venv, Source: "the checkout's .venv", Env: env}
	}
	return pythonEnv{Python: "python3", Source: "PATH", Env: env}
}

// selfPath is this binary's path with symlinks resolved ("" if unknown).
func selfPath() string {
	exe, err := os.Executable()
	if err != nil {
		return ""
	}
	if real, err := filepath.EvalSymlinks(exe); err == nil {
		return real
	}
	return exe
}

func isFile(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular()
}

func lookupEnv(env []string, key string) string {
	v := ""
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val // the last one wins, as in exec
		}
	}
	return v
}

// prependPath puts dir first in the list variable key unless it is there.
func prependPath(env []string, key, dir string) []string {
	cur := lookupEnv(env, key)
	if slices.Contains(filepath.SplitList(cur), dir) {
		return env
	}
	val := dir
	if cur != "" {
		val += string(filepath.ListSeparator) + cur
	}
	env = slices.DeleteFunc(env, func(kv string) bool { return strings.HasPrefix(kv, key+"=") })
	return append(env, key+"="+val)
}
