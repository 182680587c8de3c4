package supervisor

import (
	"fmt"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// DialGenerationUnix returns a client of an engine's generation API at
// endpoint ("unix:///path" or a bare path). The connection is made lazily,
// so a standby's client costs nothing until it is promoted.
func DialGenerationUnix(endpoint string) (frmpsv1.GenerationClient, io.Closer, error) {
	if !strings.HasPrefix(endpoint, "unix:") {
		if !strings.HasPrefix(endpoint, "/") {
			return nil, nil, fmt.Errorf("generation endpoint %q: want unix:///path", endpoint)
		}
		endpoint = "unix://" + endpoint
	}
	cc, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, fmt.Errorf("generation client: %w", err)
	}
	return frmpsv1.NewGenerationClient(cc), cc, nil
}
