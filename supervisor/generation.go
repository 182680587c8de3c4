package supervisor

import (
	"fmt"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/genstream"
)

// DialGenerationUnix returns a client of an engine's generation API at
// endpoint ("unix:///path" or a bare path); its requests share one Stream
// (genstream). It starts connecting at once (the
// engine serves the API from start-up), so a standby promoted later has its
// HTTP/2 connection ready and the first resumed request pays no handshake.
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
	cc.Connect()
	mc := genstream.New(frmpsv1.NewGenerationClient(cc))
	return mc, closeBoth{mc, cc}, nil
}

// closeBoth ends the shared generation stream, then the connection.
type closeBoth struct {
	mc *genstream.Client
	cc io.Closer
}

func (c closeBoth) Close() error {
	c.mc.Close()
	return c.cc.Close()
}
