// crdcheck validates CustomResourceDefinition files exactly as a kube-apiserver
// of the Kubernetes version it is built against does on create: the same
// apiextensions validation, CEL environment and cost budget, with no server.
// testbed/build.sh --crd-check builds one binary per version named in
// versions.env, so a test can show on which Kubernetes versions a CRD installs.
//
//	crdcheck FILE...   exit 0 when every CRD is valid; otherwise the errors, exit 1
package main

import (
	"context"
	"fmt"
	"os"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/install"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: crdcheck FILE...")
		os.Exit(2)
	}
	scheme := runtime.NewScheme()
	install.Install(scheme)
	// UniversalDecoder converts to the internal version and applies the v1 defaults,
	// as the API server does before it validates.
	decoder := serializer.NewCodecFactory(scheme).UniversalDecoder()
	failed := false
	for _, path := range os.Args[1:] {
		data, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			os.Exit(2)
		}
		obj, _, err := decoder.Decode(data, nil, nil)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: not a CustomResourceDefinition: %v\n", path, err)
			os.Exit(2)
		}
		crd, ok := obj.(*apiextensions.CustomResourceDefinition)
		if !ok {
			fmt.Fprintf(os.Stderr, "%s: a %T, not a CustomResourceDefinition\n", path, obj)
			os.Exit(2)
		}
		errs := validation.ValidateCustomResourceDefinition(context.Background(), crd)
		for _, e := range errs {
			fmt.Printf("%s: %s\n", path, e.Error())
		}
		if len(errs) > 0 {
			failed = true
		} else {
			fmt.Printf("%s: valid\n", path)
		}
	}
	if failed {
		os.Exit(1)
	}
}
