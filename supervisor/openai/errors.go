package openai

import (
	"net/http"
	"strconv"
)

// apiError is an error in OpenAI's wire shape plus the HTTP status it travels with.
type apiError struct {
	Status  int
	Message string
	Type    string
	Param   string // empty = null
	Code    string // empty = null
	// RetryAfter, when > 0, sets Retry-After (seconds) and x-should-retry: true.
	RetryAfter int
}

func (e *apiError) Error() string { return e.Message }

// Error types used by OpenAI's API.
const (
	typeInvalidRequest = "invalid_request_error"
	typeAuthentication = "authentication_error"
	typeNotFound       = "not_found_error"
	typeRateLimit      = "rate_limit_error"
	typeServer         = "server_error"
	typeUnavailable    = "service_unavailable_error"
)

func badRequest(param, msg string) *apiError {
	return &apiError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Param: param, Message: msg}
}

// appendJSON appends {"error":{...}} to b.
func (e *apiError) appendJSON(b []byte) []byte {
	b = append(b, `{"error":`...)
	return append(e.appendObject(b), '}')
}

// appendObject appends the error object, {"message","type","param","code"}.
func (e *apiError) appendObject(b []byte) []byte {
	b = append(b, `{"message":`...)
	b = appendJSONString(b, e.Message)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, e.Type)
	b = append(b, `,"param":`...)
	b = appendNullableString(b, e.Param)
	b = append(b, `,"code":`...)
	b = appendNullableString(b, e.Code)
	return append(b, '}')
}

// write sends e as a complete JSON response. Only valid before headers went out.
func (e *apiError) write(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.RetryAfter))
		h.Set("X-Should-Retry", "true")
	}
	w.WriteHeader(e.Status)
	b := e.appendJSON(make([]byte, 0, 128+len(e.Message)))
	_, _ = w.Write(append(b, '\n')) // the client may be gone; nothing to do about it
}

func appendNullableString(b []byte, s string) []byte {
	if s == "" {
		return append(b, "null"...)
	}
	return appendJSONString(b, s)
}
