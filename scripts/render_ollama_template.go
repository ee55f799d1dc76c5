// Renders the TEMPLATE of an Ollama Modelfile with Go's own text/template (the
// engine Ollama renders prompts with), for a conversation read as JSON on
// stdin: {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}.
// Prints the prompt text on stdout. The data has the fields Ollama's templates
// use: .System (the first system message), .Messages (every message, the
// system one included, as Ollama passes them), .Prompt and .Response (empty).
//
// Usage: go run scripts/render_ollama_template.go MODELFILE < conversation.json
// (or scripts/render_ollama_template.sh, which builds it once).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type Data struct {
	System   string
	Prompt   string
	Response string
	Messages []Message
}

func templateOf(modelfile string) (string, error) {
	const q = `"""`
	for _, marker := range []string{"\nTEMPLATE " + q, "TEMPLATE " + q} {
		i := strings.Index(modelfile, marker)
		if i < 0 || (marker[0] != '\n' && i != 0) {
			continue
		}
		rest := modelfile[i+len(marker):]
		j := strings.Index(rest, q)
		if j < 0 {
			return "", fmt.Errorf("unterminated TEMPLATE")
		}
		return rest[:j], nil
	}
	return "", fmt.Errorf("no TEMPLATE \"\"\"...\"\"\" in the Modelfile")
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: render_ollama_template MODELFILE < conversation.json")
		os.Exit(2)
	}
	raw, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	text, err := templateOf(string(raw))
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	var conv struct {
		Messages []Message `json:"messages"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&conv); err != nil {
		fmt.Fprintln(os.Stderr, "error: conversation JSON:", err)
		os.Exit(1)
	}
	data := Data{Messages: conv.Messages}
	for _, m := range conv.Messages {
		if m.Role == "system" {
			data.System = m.Content
			break
		}
	}
	tmpl, err := template.New("ollama").Parse(text)
	if err != nil {
		fmt.Fprintln(os.Stderr, "error: template:", err)
		os.Exit(1)
	}
	if err := tmpl.Execute(os.Stdout, data); err != nil {
		fmt.Fprintln(os.Stderr, "error: render:", err)
		os.Exit(1)
	}
}
