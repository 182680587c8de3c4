package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeWriter is a stand-in for the Python writer: it records its arguments
// and prints a directory, writing a progress line to stderr.
func fakeWriter(t *testing.T) (python, argsFile string) {
	t.Helper()
	dir := t.TempDir()
	argsFile = filepath.Join(dir, "args")
	python = filepath.Join(dir, "python")
	script := "#!/bin/sh\nprintf '%s\\n' \"$@\" > " + argsFile + "\necho 'frmps model-dir: wrote model.safetensors' >&2\necho /models/x\n"
	if err := os.WriteFile(python, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return python, argsFile
}

func TestModelDirPassesWeightsAndSeedThrough(t *testing.T) {
	python, argsFile := fakeWriter(t)
	var progress bytes.Buffer
	dir, err := modelDir(context.Background(), pythonEnv{Python: python}, "qwen2.5-7b",
		modelDirOptions{Out: "/o", Weights: "seeded", Seed: 42}, &progress)
	if err != nil || dir != "/models/x" {
		t.Fatalf("modelDir = %q, %v", dir, err)
	}
	got, _ := os.ReadFile(argsFile)
	want := "-m frmps_engine.cli model-dir qwen2.5-7b --out /o --weights seeded --seed 42"
	if strings.Join(strings.Fields(string(got)), " ") != want {
		t.Fatalf("writer argv = %q, want %q", strings.Fields(string(got)), want)
	}
	if !strings.Contains(progress.String(), "wrote model.safetensors") {
		t.Fatalf("progress not forwarded: %q", progress.String())
	}
}

func TestModelDirWithoutWeightsKeepsTodaysArguments(t *testing.T) {
	python, argsFile := fakeWriter(t)
	if _, err := modelDir(context.Background(), pythonEnv{Python: python}, "qwen2.5-7b", modelDirOptions{}, nil); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(argsFile)
	if s := strings.Join(strings.Fields(string(got)), " "); s != "-m frmps_engine.cli model-dir qwen2.5-7b" {
		t.Fatalf("writer argv = %q", s)
	}
}

func TestModelDirRefusesBadWeightsAndSeedBeforeRunningPython(t *testing.T) {
	python, argsFile := fakeWriter(t)
	for _, o := range []modelDirOptions{{Weights: "dummy"}, {Weights: "seeded", Seed: -1}} {
		if _, err := modelDir(context.Background(), pythonEnv{Python: python}, "tiny", o, nil); err == nil {
			t.Fatalf("%+v: no error", o)
		}
	}
	if _, err := os.Stat(argsFile); !os.IsNotExist(err) {
		t.Fatal("the writer ran for a refused option")
	}
}
