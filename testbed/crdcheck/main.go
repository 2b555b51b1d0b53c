// crdcheck validates CustomResourceDefinition files as a kube-apiserver of the
// Kubernetes version it is built against does on create: the same decoding
// (strict, as `kubectl apply` and `kubectl create` ask for by default), v1
// defaults, apiextensions validation, CEL environment and cost budget, with no
// server. testbed/build.sh --crd-check builds one binary per version named in
// versions.env, so a test can show on which Kubernetes versions a CRD installs.
//
// Strict: a field the version does not know (or one given twice) is an error.
// helm's create asks for no field validation: that server drops the field with
// a warning and installs the CRD without the bound or rule it carried.
//
// Every document of a file is checked (a second one is never hidden by the first).
//
//	crdcheck FILE...   exit 0 when every CRD is valid; otherwise the errors, exit 1
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/install"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: crdcheck FILE...")
		os.Exit(2)
	}
	scheme := runtime.NewScheme()
	install.Install(scheme)
	// UniversalDecoder converts to the internal version and applies the v1 defaults,
	// as the API server does before it validates; EnableStrict reports unknown and
	// duplicate fields as the server does for fieldValidation=Strict.
	decoder := serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDecoder()
	failed := false
	for _, path := range os.Args[1:] {
		docs, err := documents(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			os.Exit(2)
		}
		valid := true
		for i, doc := range docs {
			where := path
			if len(docs) > 1 {
				where = fmt.Sprintf("%s (document %d)", path, i+1)
			}
			var errs []string
			obj, _, err := decoder.Decode(doc, nil, nil)
			if err != nil {
				strict, ok := runtime.AsStrictDecodingError(err)
				if !ok || obj == nil {
					fmt.Fprintf(os.Stderr, "%s: not a CustomResourceDefinition: %v\n", where, err)
					os.Exit(2)
				}
				for _, e := range strict.Errors() {
					errs = append(errs, "strict decoding error: "+e.Error())
				}
			}
			crd, ok := obj.(*apiextensions.CustomResourceDefinition)
			if !ok {
				fmt.Fprintf(os.Stderr, "%s: a %T, not a CustomResourceDefinition\n", where, obj)
				os.Exit(2)
			}
			for _, e := range validation.ValidateCustomResourceDefinition(context.Background(), crd) {
				errs = append(errs, e.Error())
			}
			for _, e := range errs {
				fmt.Printf("%s: %s\n", where, e)
			}
			valid = valid && len(errs) == 0
		}
		if valid {
			fmt.Printf("%s: valid\n", path)
		} else {
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}

// documents splits a YAML file into its documents, leaving out empty ones (only comments or `---`).
func documents(path string) ([][]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var docs [][]byte
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		asJSON, err := utilyaml.ToJSON(doc)
		if err != nil {
			return nil, err
		}
		if trimmed := bytes.TrimSpace(asJSON); len(trimmed) == 0 || string(trimmed) == "null" {
			continue
		}
		docs = append(docs, doc)
	}
	if len(docs) == 0 {
		return nil, errors.New("no document")
	}
	return docs, nil
}
